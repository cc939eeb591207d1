"""Per-request entry state (``ReqState``) and the rows of a ``BatchStrOutput`` it receives.

Follows SGLang's ``ReqState`` (``tokenizer_manager.py``): an output list, an
event the waiting call sleeps on, and the flags of invariant 4 of docs/architecture.md
(dispatched, abort_sent, finished). ``absorb`` folds a state's queued rows into the
GenerateOutput its call sends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from ringserve import columns
from ringserve.v1 import common_pb2, detokenizer_pb2, tokenizer_pb2
from services.tokenizer.errors import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    MODEL_NOT_FOUND,
    SERVER_OVERLOADED,
    SERVICE_UNAVAILABLE,
    RequestError,
)

# Scheduler abort statuses that end the Generate call with that gRPC status
# instead of a FINISH_ABORT output (CANCELLED is a normal abort).
ERROR_STATUS_CODES = {
    "INVALID_ARGUMENT": INVALID_REQUEST,
    "RESOURCE_EXHAUSTED": SERVER_OVERLOADED,
    "UNAVAILABLE": SERVICE_UNAVAILABLE,
    "INTERNAL": INTERNAL_ERROR,
    "NOT_FOUND": MODEL_NOT_FOUND,
}


@dataclass
class Row:
    """One rid's part of one BatchStrOutput."""

    rid: str
    text: str
    output_ids: list[int]
    finish_reason: common_pb2.FinishReason
    completion_tokens: int
    cached_tokens: int
    logprobs: list[float]
    top_logprobs: list[tokenizer_pb2.TopLogprobs]
    prompt_logprobs: common_pb2.PromptLogprobs | None = None
    embedding: common_pb2.PooledEmbedding | None = None  # an embedding request's, on its final row

    @property
    def finished(self) -> bool:
        return self.finish_reason.type != common_pb2.FINISH_NONE


def split_rows(batch: detokenizer_pb2.BatchStrOutput) -> list[Row]:
    """The rows of a columnar BatchStrOutput (``ringserve.columns``).

    Called once per step: each column is read once and cut into rows by its offsets
    (indexing a protobuf repeated field per row costs more than one copy to a list), and the
    logprob columns only when the batch carries logprobs.
    """
    rids = batch.rids
    fins = batch.finish_reasons
    prompt = {p.row: p for p in batch.prompt_logprobs} if batch.prompt_logprobs else {}
    embeddings = {e.row: e for e in batch.embeddings} if batch.embeddings else {}
    if len(rids) == 1:  # one row (concurrency 1) owns every column whole
        logprobs: list[float] = []
        top: list[tokenizer_pb2.TopLogprobs] = []
        if batch.output_token_logprobs:
            logprobs = list(batch.output_token_logprobs)
            if batch.top_logprob_ids and batch.top_logprobs_nums:
                top = _top_logprobs(batch.top_logprob_ids, batch.top_logprob_vals, batch.top_logprobs_nums[0])
        return [Row(rids[0], batch.texts[0], list(batch.output_ids), fins[0], batch.completion_tokens[0],
                    batch.cached_tokens[0], logprobs, top, prompt.get(0), embeddings.get(0))]
    n = len(rids)
    ids = columns.split(batch.output_ids, batch.new_token_counts)
    row_logprobs = tops = None
    if batch.output_token_logprobs and len(batch.logprob_counts) == n:
        lp_counts = list(batch.logprob_counts)
        row_logprobs = columns.split(batch.output_token_logprobs, lp_counts)
        widths = batch.top_logprobs_nums
        if batch.top_logprob_ids and len(widths) == n:
            tops = list(map(_top_logprobs, columns.split(batch.top_logprob_ids, lp_counts, widths),
                            columns.split(batch.top_logprob_vals, lp_counts, widths), widths))
    row_logprobs = row_logprobs or [[] for _ in range(n)]
    tops = tops or [[] for _ in range(n)]
    if prompt or embeddings:
        # typeshed types zip of at most 6 iterables, so mypy cannot count the 8 columns here.
        return [Row(*cols, prompt.get(i), embeddings.get(i)) for i, cols in enumerate(zip(  # type: ignore[call-arg]
            rids, batch.texts, ids, fins, batch.completion_tokens, batch.cached_tokens, row_logprobs, tops,
            strict=True))]
    return list(map(Row, rids, batch.texts, ids, fins, batch.completion_tokens, batch.cached_tokens, row_logprobs,
                    tops))


def _top_logprobs(ids: Sequence[int], vals: Sequence[float], k: int) -> list[tokenizer_pb2.TopLogprobs]:
    """One row's top logprobs: k ids and values per token."""
    return [tokenizer_pb2.TopLogprobs(token_ids=ids[at:at + k], logprobs=vals[at:at + k])
            for at in range(0, len(ids), k)] if k > 0 else []


@dataclass(eq=False)
class ReqState:
    """Entry-side state of one (sub-)request, keyed by its rid."""

    rid: str
    parent_rid: str
    index: int
    prompt_tokens: int
    event: asyncio.Event  # shared by the sub-requests of one call
    out_list: list[Row] = field(default_factory=list)
    dispatched: bool = False
    abort_sent: bool = False
    finished: bool = False
    detached: bool = False  # its Generate call is gone; waiting for the final row
    replica: Any = None  # the manager's Dispatcher it was sent to (aborts go there too)
    request: Any = None  # the TokenizedGenerateReqInput as prepared (its sub-rid), for disagg_pair.redispatch
    answered: bool = False  # a row reached its call: it is not re-dispatched any more
    retries: int = 0  # re-dispatches after its prefill scheduler went away
    error: RequestError | None = None
    constraint_param: str | None = None  # the request field of its constraint: names a compile error
    reasoning_open: bool = False  # its prompt opened a reasoning block: said on every output
    # Non-stream accumulators: chunks are joined once, at the end.
    text_chunks: list[str] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tokenizer_pb2.TopLogprobs] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    # With prompt logprobs: the prompt ids from the requested start, and what came back.
    scored_ids: list[int] | None = None
    prompt_logprobs: common_pb2.PromptLogprobs | None = None


def absorb(st: ReqState, rows: list[Row], stream: bool) -> tokenizer_pb2.GenerateOutput | None:
    """Fold ``rows`` into ``st``; return the output to send now (stream: one merged delta)."""
    last = rows[-1]
    st.completion_tokens = last.completion_tokens
    st.cached_tokens = last.cached_tokens
    fr = last.finish_reason
    if fr.type == common_pb2.FINISH_ABORT and fr.status in ERROR_STATUS_CODES:
        status = grpc.StatusCode[fr.status]
        # INVALID_ARGUMENT after dispatch is the scheduler refusing the constraint.
        param = st.constraint_param if fr.status == "INVALID_ARGUMENT" else None
        raise RequestError(fr.message or fr.status.lower(), status, ERROR_STATUS_CODES[fr.status], param)
    prompt = next((r.prompt_logprobs for r in rows if r.prompt_logprobs is not None), None)
    if prompt is not None and st.scored_ids is not None:
        prompt.token_ids.extend(st.scored_ids)  # from the requested start; logprobs are their tail
        st.prompt_logprobs = prompt
    if stream and len(rows) == 1:
        text, ids, lps, tops = last.text, last.output_ids, last.logprobs, last.top_logprobs
    elif stream:
        text = "".join(r.text for r in rows)
        ids = [t for r in rows for t in r.output_ids]
        lps = [v for r in rows for v in r.logprobs]
        tops = [t for r in rows for t in r.top_logprobs]
    else:
        for r in rows:
            st.text_chunks.append(r.text)
            st.output_ids.extend(r.output_ids)
            st.logprobs.extend(r.logprobs)
            st.top_logprobs.extend(r.top_logprobs)
        if not last.finished:
            return None
        text, ids, lps, tops = "".join(st.text_chunks), st.output_ids, st.logprobs, st.top_logprobs
        prompt = st.prompt_logprobs
    out = tokenizer_pb2.GenerateOutput(
        rid=st.parent_rid,
        index=st.index,
        text=text,
        output_ids=ids,
        finish_reason=fr,
        prompt_tokens=st.prompt_tokens,
        completion_tokens=st.completion_tokens,
        cached_tokens=st.cached_tokens,
    )
    # Optional parts only when present: empty keyword arguments cost as much as the rest.
    if lps:
        out.output_token_logprobs.extend(lps)
    if tops:
        out.output_top_logprobs.extend(tops)
    if st.reasoning_open:
        out.reasoning_open = True
    if prompt is not None:
        out.prompt_logprobs.SetInParent()
        out.prompt_logprobs.CopyFrom(prompt)
    return out
