"""The tokenizer service's core: tokenize, validate, dispatch, and route outputs back by rid.

Follows SGLang's ``TokenizerManager``: one ``ReqState`` per in-flight rid holds
an output list and an event; the detokenizer's rows are appended to it and the
waiting ``generate`` call drains it. No gRPC here: the scheduler is reached
through a ``Dispatcher`` and outputs arrive through ``handle_batch``, so the
whole life cycle is testable without a network.

Life cycle of one request (DESIGN.md, invariants 2 and 4):

1. ``prepare``: render/tokenize, validate, expand ``n`` into sub-requests
   (sub-rid ``f"{rid}-{i}"`` when n > 1, else the rid itself).
2. register: a rid or sub-rid already in flight -> ALREADY_EXISTS, nothing sent.
3. dispatch every sub-request (``dispatched``); a down scheduler -> UNAVAILABLE.
4. rows arrive (``handle_batch``); a row with a finish reason marks the state
   finished; the call delivers it, then deletes the state.
5. the call ends early (client cancel, error): states never dispatched are
   dropped; dispatched, unfinished ones get an AbortReq (``abort_sent``) and stay
   until the scheduler's final (abort) row arrives, which deletes them.
6. a lost scheduler or detokenizer link fails every state dispatched to that
   replica with UNAVAILABLE (with several replicas, ``Balancer`` picks one per
   request and the others' requests go on).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from ringserve.metrics import ignore_seconds
from ringserve.v1 import common_pb2, detokenizer_pb2, scheduler_pb2, tokenizer_pb2
from services.tokenizer.chat import render_chat
from services.tokenizer.constraints import gate_reasoning
from services.tokenizer.errors import (
    DUPLICATE_REQUEST_ID,
    INTERNAL_ERROR,
    INVALID_REQUEST,
    SERVER_OVERLOADED,
    SERVICE_UNAVAILABLE,
    RequestError,
    invalid,
    unavailable,
)
from services.tokenizer.model import ModelFacts
from services.tokenizer.special import SpecialTokenGuard
from services.tokenizer.sampling import (
    check_prompt_logprobs,
    check_top_logprobs_num,
    resolve_sampling_params,
    seed_for_choice,
)
from services.tokenizer.state import ReqState, Row, split_rows

logger = logging.getLogger(__name__)

# Scheduler abort statuses that end the Generate call with that gRPC status
# instead of a FINISH_ABORT output (CANCELLED is a normal abort).
_ERROR_STATUS_CODES = {
    "INVALID_ARGUMENT": INVALID_REQUEST,
    "RESOURCE_EXHAUSTED": SERVER_OVERLOADED,
    "UNAVAILABLE": SERVICE_UNAVAILABLE,
    "INTERNAL": INTERNAL_ERROR,
}


def _gpt2_byte_of_char() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable character map (openai/gpt-2 encoder.py)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = [chr(b) for b in bs]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            chars.append(chr(256 + extra))
            extra += 1
    return dict(zip(chars, bs))


_BYTE_OF_CHAR = _gpt2_byte_of_char()


def _token_bytes(text: str, piece: str) -> bytes:
    """The raw bytes of one token: ``text`` when it decoded cleanly, else from its piece."""
    if "\ufffd" not in text:
        return text.encode()
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    if all(c in _BYTE_OF_CHAR for c in piece):
        return bytes(_BYTE_OF_CHAR[c] for c in piece)
    return text.encode()


class Dispatcher(Protocol):
    """The tokenizer's side of the scheduler stream. Both methods are synchronous (queue puts).

    Raises:
        RequestError: UNAVAILABLE when the scheduler stream is down.
    """

    def send_req(self, req: scheduler_pb2.TokenizedGenerateReqInput) -> None: ...

    def send_abort(self, abort: scheduler_pb2.AbortReq) -> None: ...


class Balancer(Protocol):
    """Picks the replica (a Dispatcher) for a request among several (see ``services.tokenizer.replicas``)."""

    def pick(self, input_ids: Sequence[int], outstanding: Mapping[Dispatcher, int]) -> Dispatcher:
        """The replica for a prompt, given this instance's in-flight requests per replica.

        Raises:
            RequestError: UNAVAILABLE when no replica has both links up.
        """
        ...


@dataclass(frozen=True)
class Prepared:
    """A validated request: its parent rid and one TokenizedGenerateReqInput per choice."""

    rid: str
    prompt: str | None  # rendered chat prompt or the text; None for input_ids
    subs: tuple[scheduler_pb2.TokenizedGenerateReqInput, ...]
    reasoning_open: bool = False  # the prompt opened a reasoning block (ChatInput.reasoning_start)

    @property
    def prompt_len(self) -> int:
        return len(self.subs[0].input_ids)


def _scored_ids(sub: scheduler_pb2.TokenizedGenerateReqInput) -> list[int] | None:
    """The prompt ids whose logprobs the request asked for (from logprob_start_len), or None."""
    return list(sub.input_ids[sub.logprob_start_len:]) if sub.HasField("logprob_start_len") else None


class TokenizerManager:
    """Tokenize, validate and track requests; see the module docstring for the life cycle.

    Args:
        tokenizer: a transformers tokenizer (``encode``, ``decode``, ``apply_chat_template``).
        facts: model facts (context length, vocab size, ...).
        instance_id: this tokenizer instance's id, sent with every request.
        dispatcher: the scheduler link of the only replica; set later with ``attach`` when None.
        outputs_up: whether the detokenizer subscription is up (the service keeps it current).
        balancer: several replicas; when given, each request goes to ``balancer.pick``
            (``dispatcher`` and ``outputs_up`` are then unused).
        allow_special_tokens_in_messages: parse control tokens that chat message text
            spells (``<|im_end|>``) as those tokens; by default they stay text (see
            ``services.tokenizer.special``).
    """

    def __init__(
        self,
        tokenizer: Any,
        facts: ModelFacts,
        instance_id: str,
        dispatcher: Dispatcher | None = None,
        outputs_up: bool = True,
        allow_special_tokens_in_messages: bool = False,
        balancer: Balancer | None = None,
    ):
        self.tokenizer = tokenizer
        self.guard = None if allow_special_tokens_in_messages else SpecialTokenGuard(tokenizer)
        self.facts = facts
        self.instance_id = instance_id
        self.dispatcher = dispatcher
        # Whether outputs can reach this instance (the detokenizer subscription is up);
        # requests are refused while they cannot, instead of waiting forever.
        self.outputs_up = outputs_up
        self.balancer = balancer
        # Dispatched, not yet forgotten states per replica: the router's "outstanding work".
        self.outstanding: Counter[Dispatcher] = Counter()
        self.rid_to_state: dict[str, ReqState] = {}
        self._parents: dict[str, int] = {}  # parent rid -> live sub-states
        self.observe_tokenize = ignore_seconds  # seconds prepare() took (services/tokenizer/metrics.py)

    def attach(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    # --- tokenization and validation -------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_ids(self, ids: Any, param: str) -> list[int]:
        """``ids`` as a list, after checking it is non-empty and inside [0, vocab_size).

        Raises:
            RequestError: INVALID_ARGUMENT.
        """
        ids = list(ids)
        if not ids:
            raise invalid(f"{param} must not be empty", param)
        vocab = self.facts.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param)
        return ids

    def _added_special_tokens(self) -> tuple[list[int], list[int]]:
        """The ids ``encode(add_special_tokens=True)`` puts before and after a text (BOS, EOS)."""
        plain = self.encode("a", add_special_tokens=False)
        full = self.encode("a", add_special_tokens=True)
        at = next(i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain)
        return full[:at], full[at + len(plain) :]

    def render_chat_ids(self, chat: tokenizer_pb2.ChatInput) -> tuple[str, list[int]]:
        """(rendered prompt, its ids without added special tokens); control tokens that the
        messages spell stay text unless ``allow_special_tokens_in_messages``.

        Raises:
            RequestError: INVALID_ARGUMENT (see ``render_chat``).
        """
        if self.guard is None:
            prompt = render_chat(self.tokenizer, chat)
            return prompt, self.encode(prompt, add_special_tokens=False)
        masked, nonce, found = self.guard.mask(chat)
        return self.guard.encode(render_chat(self.tokenizer, masked), nonce, found)

    def prompt_ids(self, req: tokenizer_pb2.GenerateReqInput) -> tuple[list[int], str | None, str]:
        """(input ids, prompt text or None, OpenAI param name) of a GenerateReqInput.

        Text is tokenized with the tokenizer's default special tokens; a rendered chat
        prompt without (the template already holds them); input_ids are taken as they are.

        Raises:
            RequestError: INVALID_ARGUMENT (no input, empty prompt, bad ids, chat errors).
        """
        which = req.WhichOneof("input")
        if which == "text":
            ids = self.encode(req.text)
            if not ids:
                raise invalid("the prompt is empty (0 tokens)", "prompt")
            return ids, req.text, "prompt"
        if which == "input_ids":
            return self.check_ids(req.input_ids.ids, "input_ids"), None, "prompt"
        if which == "chat":
            prompt, ids = self.render_chat_ids(req.chat)
            if not ids:
                raise invalid("the rendered chat prompt is empty (0 tokens)", "messages")
            return ids, prompt, "messages"
        raise invalid("one of text, input_ids or chat is required", "prompt", INVALID_REQUEST)

    def prepare(self, req: tokenizer_pb2.GenerateReqInput) -> Prepared:
        """Tokenize and validate ``req``; expand n > 1 into sub-requests sharing the prompt.

        Makes a rid (uuid4 hex) when ``req.rid`` is empty. Sub-rids are ``f"{rid}-{i}"``
        when n > 1 (seeds ``seed + i`` when seeded), else the rid itself.

        Raises:
            RequestError: INVALID_ARGUMENT (see ``prompt_ids`` and ``resolve_sampling_params``).
        """
        ids, prompt, param = self.prompt_ids(req)
        check_top_logprobs_num(req.top_logprobs_num)
        check_prompt_logprobs(req, len(ids))
        resolved = resolve_sampling_params(
            req.sampling_params, len(ids), self.facts.context_length, self.facts.vocab_size, param,
            score_only_ok=req.HasField("logprob_start_len"),
        )
        start = req.chat.reasoning_start if req.WhichOneof("input") == "chat" else ""
        opened = gate_reasoning(resolved.params, prompt, start, lambda t: self.encode(t, add_special_tokens=False))
        rid = req.rid or uuid.uuid4().hex
        subs = []
        for i in range(resolved.n):
            params = resolved.params
            if resolved.n > 1 and params.HasField("seed"):
                params = common_pb2.ResolvedSamplingParams()
                params.CopyFrom(resolved.params)
                params.seed = seed_for_choice(resolved.params.seed, i)
            subs.append(
                scheduler_pb2.TokenizedGenerateReqInput(
                    rid=f"{rid}-{i}" if resolved.n > 1 else rid,
                    input_ids=ids,
                    sampling_params=params,
                    return_logprob=req.return_logprob,
                    top_logprobs_num=req.top_logprobs_num,
                    tokenizer_id=self.instance_id,
                    stream=req.stream,
                    logprob_start_len=req.logprob_start_len if req.HasField("logprob_start_len") else None,
                    prompt_top_logprobs_num=req.prompt_top_logprobs_num,
                )
            )
        return Prepared(rid, prompt, tuple(subs), opened)

    # --- ReqState bookkeeping ------------------------------------------------------------

    def register(self, prepared: Prepared) -> list[ReqState]:
        """Create the ReqStates of a prepared request.

        Raises:
            RequestError: ALREADY_EXISTS when the rid or a sub-rid is in flight; the
                in-flight request is left untouched and nothing is registered.
        """
        rids = [sub.rid for sub in prepared.subs]
        taken = [r for r in {prepared.rid, *rids} if r in self.rid_to_state or r in self._parents]
        if taken:
            raise RequestError(
                f"request id {sorted(taken)[0]!r} is already in flight",
                grpc.StatusCode.ALREADY_EXISTS,
                DUPLICATE_REQUEST_ID,
                "rid",
            )
        event = asyncio.Event()
        states = [
            ReqState(sub.rid, prepared.rid, i, prepared.prompt_len, event, scored_ids=_scored_ids(sub),
                     constraint_param=sub.sampling_params.constraint.param or None,
                     reasoning_open=prepared.reasoning_open)
            for i, sub in enumerate(prepared.subs)
        ]
        for st in states:
            self.rid_to_state[st.rid] = st
        self._parents[prepared.rid] = len(states)
        return states

    def _forget(self, st: ReqState) -> None:
        if self.rid_to_state.get(st.rid) is not st:
            return
        del self.rid_to_state[st.rid]
        if st.dispatched and st.replica is not None:
            self.outstanding[st.replica] -= 1
            if not self.outstanding[st.replica]:
                del self.outstanding[st.replica]
        left = self._parents[st.parent_rid] - 1
        if left:
            self._parents[st.parent_rid] = left
        else:
            del self._parents[st.parent_rid]

    def _send_abort(self, st: ReqState, reason: str) -> None:
        """AbortReq for a dispatched, unfinished state; drop it if the scheduler is unreachable."""
        if st.abort_sent or st.finished:
            return
        try:
            assert st.replica is not None
            st.replica.send_abort(
                scheduler_pb2.AbortReq(rid=st.rid, reason=reason, tokenizer_id=self.instance_id)
            )
        except RequestError:
            # No stream, no final row: the scheduler drops this tokenizer's requests with the stream.
            self._forget(st)
            return
        st.abort_sent = True

    def release(self, states: list[ReqState], reason: str) -> None:
        """End of a Generate call: drop what is done or never dispatched, abort the rest.

        Dispatched, unfinished states get an AbortReq and stay (detached) until the
        scheduler's final row deletes them (DESIGN.md invariant 4).
        """
        for st in states:
            if self.rid_to_state.get(st.rid) is not st:
                continue
            if st.finished or not st.dispatched:
                self._forget(st)
            else:
                st.detached = True
                self._send_abort(st, reason)

    def abort(self, rid: str, reason: str = "aborted by the client") -> bool:
        """Abort a request (a parent rid aborts every choice) or one sub-rid; True if found.

        The Generate call, if any, still receives the final FINISH_ABORT output.
        """
        states = [st for st in self.rid_to_state.values() if st.rid == rid or st.parent_rid == rid]
        for st in states:
            if st.dispatched:
                self._send_abort(st, reason)
            else:
                self._forget(st)
        return bool(states)

    def fail_all(self, error: RequestError, send_aborts: bool, replica: Dispatcher | None = None) -> int:
        """Fail every in-flight request with ``error`` (a link went down); return how many.

        With ``replica``, only the requests dispatched to that replica fail (one of its
        links went down; the other replicas' requests go on). With ``send_aborts`` (the
        detokenizer link is lost but the scheduler's is up), dispatched requests are also
        aborted at the scheduler. States are dropped at once: no final row can arrive on
        a lost link.
        """
        states = [st for st in self.rid_to_state.values() if replica is None or st.replica is replica]
        for st in states:
            if send_aborts and st.dispatched and not st.abort_sent and st.replica is not None:
                try:
                    st.replica.send_abort(
                        scheduler_pb2.AbortReq(rid=st.rid, reason=error.message, tokenizer_id=self.instance_id)
                    )
                except RequestError:
                    pass  # the scheduler is gone too; it drops our requests with the stream
            st.error = error
            st.finished = True
            self._forget(st)
            st.event.set()
        return len(states)

    def handle_batch(self, batch: detokenizer_pb2.BatchStrOutput) -> None:
        """Route each row of a BatchStrOutput to its ReqState (rows of unknown rids are dropped)."""
        for row in split_rows(batch):
            st = self.rid_to_state.get(row.rid)
            if st is None:
                logger.debug("dropping a row for unknown rid %s", row.rid)
                continue
            if row.finished:
                fr = row.finish_reason
                if fr.type == common_pb2.FINISH_ABORT and fr.status in _ERROR_STATUS_CODES:
                    # An error row may come from the detokenizer while the scheduler still
                    # runs the request; an abort for a rid it already dropped is a no-op.
                    self._send_abort(st, f"output path failed: {fr.message}")
                st.finished = True
            if st.detached:
                if row.finished:
                    self._forget(st)
                continue
            st.out_list.append(row)
            st.event.set()

    # --- Generate ---------------------------------------------------------------------------

    def _absorb(self, st: ReqState, rows: list[Row], stream: bool) -> tokenizer_pb2.GenerateOutput | None:
        """Fold ``rows`` into ``st``; return the output to send now (stream: one merged delta)."""
        last = rows[-1]
        st.completion_tokens = last.completion_tokens
        st.cached_tokens = last.cached_tokens
        fr = last.finish_reason
        if fr.type == common_pb2.FINISH_ABORT and fr.status in _ERROR_STATUS_CODES:
            status = grpc.StatusCode[fr.status]
            # INVALID_ARGUMENT after dispatch is the scheduler refusing the constraint.
            param = st.constraint_param if fr.status == "INVALID_ARGUMENT" else None
            raise RequestError(fr.message or fr.status.lower(), status, _ERROR_STATUS_CODES[fr.status], param)
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

    async def generate(self, req: tokenizer_pb2.GenerateReqInput) -> AsyncIterator[tokenizer_pb2.GenerateOutput]:
        """Serve one Generate call: yield GenerateOutputs until every choice finished.

        stream=true: one output per drain of a choice's queued rows (rows queued while
        the consumer was busy are merged into one delta). stream=false: one final
        output per choice, with the whole text and all output ids.

        Raises:
            RequestError: INVALID_ARGUMENT / ALREADY_EXISTS before dispatch; UNAVAILABLE
                when a link is down or lost; the scheduler's status for an error abort.
        Cancelling or closing the generator before the end aborts every dispatched choice.
        """
        started = time.perf_counter()
        prepared = self.prepare(req)
        self.observe_tokenize(time.perf_counter() - started)
        replica = self._choose(prepared)
        states = self.register(prepared)
        reason = "the Generate call ended before the request finished"
        try:
            for st, sub in zip(states, prepared.subs):
                replica.send_req(sub)  # every choice on one replica: they share the prompt's cache
                st.dispatched = True
                st.replica = replica
                self.outstanding[replica] += 1
            event = states[0].event
            pending = list(states)
            while pending:
                if not any(st.out_list or st.error for st in pending):
                    await event.wait()
                event.clear()
                for st in list(pending):
                    if st.error is not None:
                        raise st.error
                    if not st.out_list:
                        continue
                    rows, st.out_list = st.out_list, []
                    out = self._absorb(st, rows, req.stream)
                    if rows[-1].finished:
                        pending.remove(st)
                    if out is not None:
                        yield out
                    if rows[-1].finished:
                        self._forget(st)
        except asyncio.CancelledError:
            reason = "the client cancelled the Generate call"
            raise
        finally:
            self.release(states, reason)

    def _choose(self, prepared: Prepared) -> Dispatcher:
        """The replica for ``prepared``. Raises RequestError (UNAVAILABLE) when none can take it."""
        if self.balancer is not None:
            return self.balancer.pick(prepared.subs[0].input_ids, self.outstanding)
        if self.dispatcher is None:
            raise unavailable("the scheduler is not connected")
        if not self.outputs_up:
            raise unavailable("the detokenizer subscription is down")
        return self.dispatcher

    # --- unary helpers -----------------------------------------------------------------------

    def tokenize(self, req: tokenizer_pb2.TokenizeRequest) -> tokenizer_pb2.TokenizeResponse:
        """Text or chat -> ids, with special tokens added only if ``add_special_tokens``.

        Raises:
            RequestError: INVALID_ARGUMENT (no input, chat errors).
        """
        which = req.WhichOneof("input")
        if which == "text":
            prompt = req.text
            ids = self.encode(prompt, add_special_tokens=req.add_special_tokens)
        elif which == "chat":
            prompt, ids = self.render_chat_ids(req.chat)
            if req.add_special_tokens:
                prefix, suffix = self._added_special_tokens()
                ids = prefix + ids + suffix
        else:
            raise invalid("one of text or chat is required", "prompt", INVALID_REQUEST)
        return tokenizer_pb2.TokenizeResponse(
            input_ids=ids, prompt=prompt, count=len(ids), max_model_len=self.facts.context_length
        )

    def detokenize(self, req: tokenizer_pb2.DetokenizeRequest) -> tokenizer_pb2.DetokenizeResponse:
        """ids -> text. Raises RequestError (INVALID_ARGUMENT) for ids outside the vocabulary."""
        ids = list(req.ids)
        if ids:
            self.check_ids(ids, "ids")
        return tokenizer_pb2.DetokenizeResponse(
            text=self.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
        )

    def token_pieces(self, req: tokenizer_pb2.TokenIds) -> tokenizer_pb2.TokenPiecesResponse:
        """Each id decoded alone (special tokens kept) and its raw bytes, for logprobs.

        Bytes follow the vocabulary: byte-level BPE pieces map back through GPT-2's byte
        alphabet and ``<0xNN>`` byte-fallback pieces are that byte, so the bytes of a
        multi-byte character's pieces concatenate to the character even where each text
        is U+FFFD; otherwise the UTF-8 of the text.

        Raises:
            RequestError: INVALID_ARGUMENT for ids outside the vocabulary.
        """
        ids = self.check_ids(req.ids, "ids") if req.ids else []
        texts = self.tokenizer.backend_tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
        pieces = self.tokenizer.convert_ids_to_tokens(ids)
        out = [_token_bytes(text, piece) for text, piece in zip(texts, pieces)]
        return tokenizer_pb2.TokenPiecesResponse(texts=texts, token_bytes=out)

    def model_info(self) -> tokenizer_pb2.ModelInfo:
        f = self.facts
        return tokenizer_pb2.ModelInfo(
            model_path=f.model_path,
            served_model_name=f.served_model_name,
            context_length=f.context_length,
            vocab_size=f.vocab_size,
            has_chat_template=f.has_chat_template,
            eos_token_ids=f.eos_token_ids,
        )

    def load(self) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(instance_id=self.instance_id, req_states=len(self.rid_to_state))
