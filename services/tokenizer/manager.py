"""The tokenizer service's core: tokenize, validate, dispatch, and route outputs back by rid.

Follows SGLang's ``TokenizerManager``: one ``ReqState`` per in-flight rid holds
an output list and an event; the detokenizer's rows are appended to it and the
waiting ``generate`` call drains it. No gRPC here: the scheduler is reached
through a ``Dispatcher`` and outputs arrive through ``handle_batch``, so the
whole life cycle is testable without a network.

Life cycle of one request (docs/architecture.md, invariants 2 and 4):

1. ``prepare`` (``services.tokenizer.prepare``): the input bounds (``services.tokenizer.
   bounds``) on the loop, then render/tokenize, validate, expand ``n`` into sub-requests
   (sub-rid ``f"{rid}-{i}"`` when n > 1, else the rid itself) on a worker thread
   (``services.tokenizer.workers``).
2. register: a rid or sub-rid already in flight -> ALREADY_EXISTS, nothing sent.
3. dispatch every sub-request (``dispatched``); a down scheduler -> UNAVAILABLE.
4. rows arrive (``handle_batch``); a row with a finish reason marks the state
   finished; the call delivers it, then deletes the state.
5. the call ends early (client cancel, error): states never dispatched are
   dropped; dispatched, unfinished ones get an AbortReq (``abort_sent``) and stay
   until the scheduler's final (abort) row arrives, which deletes them.
6. a lost scheduler or detokenizer link fails every state dispatched to that
   replica with UNAVAILABLE (with several replicas, ``Balancer`` picks one per
   request and the others' requests go on); a prefill/decode pair's request whose
   call saw no output yet goes to another pair instead (``services.tokenizer.disagg_pair``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from typing import Any

import grpc

from ringserve import priority, tracing
from ringserve.metrics import ignore_seconds
from ringserve.prompt_bounds import BoundExceeded
from ringserve.v1 import common_pb2, detokenizer_pb2, scheduler_pb2, tokenizer_pb2
from services.tokenizer import disagg_pair
from services.tokenizer.bounds import InputBounds
from services.tokenizer.dispatch import Balancer, Dispatcher
from services.tokenizer.errors import DUPLICATE_REQUEST_ID, RequestError, invalid, unavailable
from services.tokenizer.model import ModelFacts
from services.tokenizer.prepare import Prepared, Preparer
from services.tokenizer.request_trace import trace_prepared
from services.tokenizer.state import ERROR_STATUS_CODES, ReqState, absorb, split_rows
from services.tokenizer.workers import Workers

logger = logging.getLogger(__name__)


def _bounded(check: Callable[[Any], None], req: Any) -> None:
    """``check(req)``, a ``BoundExceeded`` raised as RequestError (INVALID_ARGUMENT, its code and param)."""
    try:
        check(req)
    except BoundExceeded as exc:
        raise invalid(exc.message, exc.param, exc.code) from None


def _check_priority(value: int, replica: Dispatcher) -> None:
    """Refuse a priority the chosen scheduler cannot honour (``ringserve.priority``), before
    dispatch. While its policy is unknown (no LoadReport yet) the scheduler checks it itself."""
    policy = replica.schedule_policy if value else None
    error = priority.refusal(value, policy) if policy is not None else None
    if error is not None:
        raise invalid(error, "priority")


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
        workers: where rendering and tokenization run; default: on the loop (tests).
        bounds: the input bounds; default: derived from ``tokenizer`` and ``facts``.
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
        workers: Workers | None = None,
        bounds: InputBounds | None = None,
    ):
        self.preparer = Preparer(tokenizer, facts, instance_id, allow_special_tokens_in_messages)
        self.workers = workers or Workers()
        if bounds is None:
            bounds, unbounded = InputBounds.of(tokenizer, facts)
            if unbounded:
                logger.warning("no character bound on prompts: %s; long prompts are tokenized before "
                               "their context-length check", unbounded)
        self.bounds = bounds
        self.tokenizer = tokenizer
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

    def prepare(self, req: tokenizer_pb2.GenerateReqInput) -> Prepared:
        """``Preparer.prepare`` on this thread."""
        return self.preparer.prepare(req)

    def render_chat_ids(self, chat: tokenizer_pb2.ChatInput) -> tuple[str, list[int]]:
        """``Preparer.render_chat_ids`` on this thread."""
        return self.preparer.render_chat_ids(chat)

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
            self._count(st.replica, -1)
        left = self._parents[st.parent_rid] - 1
        if left:
            self._parents[st.parent_rid] = left
        else:
            del self._parents[st.parent_rid]

    def _count(self, replica: Dispatcher, delta: int) -> None:
        """Add ``delta`` to ``replica``'s outstanding work (no entry at zero)."""
        self.outstanding[replica] += delta
        if not self.outstanding[replica]:
            del self.outstanding[replica]

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
        scheduler's final row deletes them (docs/architecture.md, invariant 4).
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
        states = [st for st in self.rid_to_state.values()
                  if rid in (st.rid, st.parent_rid) or (st.request is not None and st.request.rid == rid)]
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
        a lost link. A request whose pair's prefill replica is ``replica`` and whose call saw
        no output goes to another pair instead (``_retry_prefill``) and is not counted.
        """
        states = [st for st in self.rid_to_state.values() if replica is None or st.replica is replica
                  or replica in getattr(st.replica, "members", ())]  # a prefill/decode pair it is part of
        states = [st for st in states if replica is None or not self._retry_prefill(st, replica)]
        for st in states:
            # A pair's other member still holds the request: it gets the abort whatever the link lost.
            paired = replica is not None and st.replica is not replica
            if (send_aborts or paired) and st.dispatched and not st.abort_sent and st.replica is not None:
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

    def _retry_prefill(self, st: ReqState, lost: Dispatcher) -> bool:
        """Move ``st`` to another pair when ``lost`` was its pair's prefill replica and nothing
        reached its call (``disagg_pair.redispatch``); True when it went."""
        moved = disagg_pair.redispatch(st, lost, self.balancer, self.outstanding, self.instance_id)
        if moved is None:
            return False
        other, rid = moved
        self._count(st.replica, -1)
        self._count(other, 1)
        del self.rid_to_state[st.rid]
        st.rid, st.replica, st.retries = rid, other, st.retries + 1
        self.rid_to_state[rid] = st
        return True

    def handle_batch(self, batch: detokenizer_pb2.BatchStrOutput) -> None:
        """Route each row of a BatchStrOutput to its ReqState (rows of unknown rids are dropped)."""
        for row in split_rows(batch):
            st = self.rid_to_state.get(row.rid)
            if st is None:
                logger.debug("dropping a row for unknown rid %s", row.rid)
                continue
            if row.finished:
                fr = row.finish_reason
                if fr.type == common_pb2.FINISH_ABORT and fr.status in ERROR_STATUS_CODES:
                    # An error row may come from the detokenizer while the scheduler still
                    # runs the request; an abort for a rid it already dropped is a no-op.
                    self._send_abort(st, f"output path failed: {fr.message}")
                st.finished = True
            if st.detached:
                if row.finished:
                    self._forget(st)
                continue
            st.out_list.append(row)
            st.answered = True
            st.event.set()

    # --- Generate ---------------------------------------------------------------------------

    async def generate(self, req: tokenizer_pb2.GenerateReqInput) -> AsyncGenerator[tokenizer_pb2.GenerateOutput, None]:
        """Serve one Generate call: yield GenerateOutputs until every choice finished.

        stream=true: one output per drain of a choice's queued rows (rows queued while
        the consumer was busy are merged into one delta). stream=false: one final
        output per choice, with the whole text and all output ids.

        Raises:
            RequestError: INVALID_ARGUMENT / ALREADY_EXISTS before dispatch; UNAVAILABLE
                when a link is down or lost; the scheduler's status for an error abort.
        Cancelling or closing the generator before the end aborts every dispatched choice.
        """
        started, started_ns = time.perf_counter(), time.time_ns()
        _bounded(self.bounds.check_generate, req)
        prepared = await self.workers.run(self.preparer.prepare, req)
        self.observe_tokenize(time.perf_counter() - started)
        if tracing.tracer is not None:
            trace_prepared(prepared, started_ns)
        states = self.dispatch(prepared, req.priority)
        reason = "the Generate call ended before the request finished"
        try:
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
                    out = absorb(st, rows, req.stream)
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

    def dispatch(self, prepared: Prepared, priority: int = 0) -> list[ReqState]:
        """Choose a replica, register ``prepared``'s states and send every sub-request there
        (one replica: they share the prompt's cache). The caller releases the states
        (``release``) when its call ends; a failed send releases them here.

        Raises:
            RequestError: UNAVAILABLE (no replica, a link down), ALREADY_EXISTS (``register``),
                INVALID_ARGUMENT (a ``priority`` the chosen scheduler cannot honour).
        """
        replica = self._choose(prepared)
        _check_priority(priority, replica)
        states = self.register(prepared)
        try:
            for st, sub in zip(states, prepared.subs, strict=True):
                replica.send_req(sub)
                st.dispatched = True
                st.replica = replica
                st.request = sub
                self.outstanding[replica] += 1
        except BaseException:
            self.release(states, "the request could not be dispatched")
            raise
        return states

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

    # Each checks its input bound on the loop, then runs ``Preparer``'s method of that name
    # (which documents it) through ``workers``. Raises RequestError (INVALID_ARGUMENT).

    async def tokenize(self, req: tokenizer_pb2.TokenizeRequest) -> tokenizer_pb2.TokenizeResponse:
        _bounded(self.bounds.check_tokenize, req)
        return await self.workers.run(self.preparer.tokenize, req)

    async def detokenize(self, req: tokenizer_pb2.DetokenizeRequest) -> tokenizer_pb2.DetokenizeResponse:
        _bounded(self.bounds.check_detokenize, req)
        return await self.workers.run(self.preparer.detokenize, req)

    async def token_pieces(self, req: tokenizer_pb2.TokenIds) -> tokenizer_pb2.TokenPiecesResponse:
        _bounded(self.bounds.check_token_pieces, req)
        return await self.workers.run(self.preparer.token_pieces, req)

    def model_info(self) -> tokenizer_pb2.ModelInfo:
        f = self.facts
        return tokenizer_pb2.ModelInfo(
            model_path=f.model_path,
            served_model_name=f.served_model_name,
            context_length=f.context_length,
            vocab_size=f.vocab_size,
            has_chat_template=f.has_chat_template,
            eos_token_ids=f.eos_token_ids,
            chars_per_token=self.bounds.chars_per_token or 0,
            tool_call_parser=f.tool_call_parser,
        )

    def load(self) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(instance_id=self.instance_id, req_states=len(self.rid_to_state))
