"""Embeddings (the ``Embed`` RPC): tokenize and check every input, send each to the scheduler as a
request that only prefills (``TokenizedGenerateReqInput.embed``), and gather the pooled vectors
that come back through the detokenizer on each request's final row.

The inputs of one call are the sub-requests ``f"{rid}-{i}"`` of one parent rid, sent to one
replica like the choices of a Generate call, so they share its ``ReqState`` life cycle
(``services.tokenizer.manager``): a cancelled call aborts every input still running, and an
input that fails ends the call with its error.

Text is tokenized with the tokenizer's special tokens, as its post-processor adds them: a
decoder embedding model that pools its last token says there what the last token is
(Qwen3-Embedding's tokenizer appends ``<|endoftext|>`` to every text; SmolLM2's adds nothing).
Token ids are taken as they are, as OpenAI and vLLM take them.
"""

from __future__ import annotations

import asyncio
import uuid
from functools import partial
from pathlib import Path

import grpc

from ringserve.modelfacts import EmbeddingFacts, embedding_facts
from ringserve.prompt_bounds import CONTEXT_LENGTH_EXCEEDED
from ringserve.sampling_params import resolved_defaults
from ringserve.v1 import common_pb2, scheduler_pb2, tokenizer_pb2
from services.tokenizer.errors import INTERNAL_ERROR, RequestError, invalid
from services.tokenizer.manager import TokenizerManager
from services.tokenizer.prepare import Prepared, Preparer
from services.tokenizer.state import ERROR_STATUS_CODES, ReqState

# Inputs per call: OpenAI's limit for /v1/embeddings.
MAX_EMBED_INPUTS = 2048


class Embedder:
    """Serves ``Embed`` calls over a ``TokenizerManager`` (its preparer, workers, replicas and states).

    Args:
        manager: the tokenizer core.
        facts: the model's embedding facts; default: read from ``manager.facts.model_path``.
    """

    def __init__(self, manager: TokenizerManager, facts: EmbeddingFacts | None = None):
        self.manager = manager
        self.facts = facts or embedding_facts(Path(manager.facts.model_path))

    async def embed(self, req: tokenizer_pb2.EmbedRequest) -> tokenizer_pb2.EmbedResponse:
        """Embed every input of ``req``; one vector per input, in order.

        Raises:
            RequestError: INVALID_ARGUMENT (param "input" or "dimensions") before dispatch;
                ALREADY_EXISTS, UNAVAILABLE as Generate; the scheduler's status when an input
                is refused or aborted after dispatch.
        Cancelling the call aborts every input still running.
        """
        self._check_sizes(req)
        m = self.manager
        prepared = await m.workers.run(partial(prepare_embed, m.preparer, facts=self.facts), req)
        states = m.dispatch(prepared)
        reason = "the Embed call ended before every input was embedded"
        try:
            vectors = await _gather(states)
        except asyncio.CancelledError:
            reason = "the client cancelled the Embed call"
            raise
        finally:
            m.release(states, reason)
        out = tokenizer_pb2.EmbedResponse()
        for sub, values in zip(prepared.subs, vectors, strict=True):
            out.embeddings.add(values=values, prompt_tokens=len(sub.input_ids))
        out.prompt_tokens = sum(len(sub.input_ids) for sub in prepared.subs)
        return out

    def _check_sizes(self, req: tokenizer_pb2.EmbedRequest) -> None:
        """The input count, and each text against the characters the context can hold, on the
        loop before any text is tokenized (``ringserve.prompt_bounds``)."""
        if not req.inputs:
            raise invalid("input must not be empty", "input")
        if len(req.inputs) > MAX_EMBED_INPUTS:
            raise invalid(f"input holds {len(req.inputs)} inputs; at most {MAX_EMBED_INPUTS} are allowed", "input")
        per_token = self.manager.bounds.chars_per_token
        if per_token is None:
            return
        limit = self.manager.facts.context_length * per_token
        for i, item in enumerate(req.inputs):
            if item.WhichOneof("input") == "text" and len(item.text) > limit:
                raise invalid(f"{_where(req, i)} has {len(item.text)} characters; more than {limit} cannot fit this "
                              f"model's maximum context length of {self.manager.facts.context_length} tokens",
                              "input", CONTEXT_LENGTH_EXCEEDED)


def _where(req: tokenizer_pb2.EmbedRequest, i: int) -> str:
    return f"input[{i}]" if len(req.inputs) > 1 else "input"


def prepare_embed(preparer: Preparer, req: tokenizer_pb2.EmbedRequest, facts: EmbeddingFacts) -> Prepared:
    """Tokenize and check ``req``'s inputs -> one embedding request per input, ``f"{rid}-{i}"``.

    Raises:
        RequestError: INVALID_ARGUMENT: an empty input, an id outside the vocabulary, an input
            over the context length (param "input"); ``dimensions`` the model does not declare
            (param "dimensions").
    """
    if req.dimensions < 0:
        raise invalid(f"dimensions must be positive, got {req.dimensions}", "dimensions")
    if req.dimensions:
        refusal = facts.dimensions_refusal(req.dimensions)
        if refusal is not None:
            raise invalid(refusal, "dimensions")
    context = preparer.facts.context_length
    vocab = preparer.facts.vocab_size
    params = common_pb2.ResolvedSamplingParams(**{**resolved_defaults(), "max_new_tokens": 0})  # type: ignore[arg-type]
    rid = req.rid or uuid.uuid4().hex
    subs = []
    for i, item in enumerate(req.inputs):
        where = _where(req, i)
        which = item.WhichOneof("input")
        if which == "text":
            if not item.text:
                raise invalid(f"{where} is an empty string", "input")
            ids = preparer.encode(item.text)
        elif which == "input_ids":
            ids = list(item.input_ids.ids)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise invalid(f"{where}: token id {bad} is outside the vocabulary [0, {vocab})", "input")
        else:
            raise invalid(f"{where}: one of text or input_ids is required", "input")
        if not ids:
            raise invalid(f"{where} is empty (0 tokens)", "input")
        if len(ids) > context:
            raise invalid(f"This model's maximum context length is {context} tokens. However, {where} has "
                          f"{len(ids)} tokens. Please reduce the length of the input.", "input",
                          CONTEXT_LENGTH_EXCEEDED)
        subs.append(scheduler_pb2.TokenizedGenerateReqInput(
            rid=f"{rid}-{i}", input_ids=ids, sampling_params=params, tokenizer_id=preparer.instance_id,
            embed=True, embed_dimensions=req.dimensions))
    return Prepared(rid, None, tuple(subs))


async def _gather(states: list[ReqState]) -> list[list[float]]:
    """Wait for every state's final row -> its embedding, in the states' order.

    Raises:
        RequestError: a lost link (the state's error), or the final row's abort status
            (CANCELLED for an abort asked by a client).
    """
    vectors: dict[int, list[float]] = {}
    event = states[0].event
    pending = list(states)
    while pending:
        if not any(st.out_list or st.error for st in pending):
            await event.wait()
        event.clear()
        waiting = []
        for st in pending:
            if st.error is not None:
                raise st.error
            rows, st.out_list = st.out_list, []
            end = next((r for r in rows if r.finished), None)
            if end is None:
                waiting.append(st)
                continue
            fr = end.finish_reason
            if fr.type == common_pb2.FINISH_ABORT:
                status = grpc.StatusCode.__members__.get(fr.status, grpc.StatusCode.CANCELLED)
                code = ERROR_STATUS_CODES.get(fr.status, "request_aborted")
                raise RequestError(fr.message or "aborted", status, code,
                                   "input" if fr.status == "INVALID_ARGUMENT" else None)
            if end.embedding is None:
                raise RequestError(f"the scheduler ended {st.rid} without its embedding", grpc.StatusCode.INTERNAL,
                                   INTERNAL_ERROR)
            vectors[st.index] = list(end.embedding.values)
        pending = waiting
    return [vectors[i] for i in range(len(states))]
