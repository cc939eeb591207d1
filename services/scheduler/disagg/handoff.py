"""The engine-thread state of both sides of a disaggregated request.

Decode side: a request whose part is ``Role.DECODE`` waits in ``waiting`` until a request slot
and KV rows for its whole prompt are free (backpressure: the prefill side's ``Reserve`` call
waits with it, so a transfer never lands in a full pool), then holds them in ``reserved`` until
the prefill side commits: its first token is appended, stops are checked, its first row goes to
the detokenizer and it joins the running batch with ``kv_len`` = prompt length. An abort before
the commit frees the reserved rows without caching them (they hold no valid KV); a reservation
that no commit follows within ``timeout_s`` ends with DEADLINE_EXCEEDED.

Prefill side: a request whose part is ``Role.PREFILL`` runs its prompt as any other (chunked
prefill, prefix cache); in the step that samples its first token it leaves the running batch
without a row for the detokenizer, keeps its slot and rows while ``on_handoff``'s sender moves
them (``sending``), and on ``handed`` releases them into its own prefix cache -- or, when the
transfer failed, ends with a FINISH_ABORT row that names why.

Nothing here is thread-safe but ``lock``, which the decode side's receiver takes around each
write into reserved rows, so an abort never frees rows a write is landing in. A transfer engine
that writes from the peer (``one_sided``: mooncake) cannot take that lock: once its reservation
went out (``lend``) and until the sender says it is done (``writer_done``: its lease stream
ended, or the commit arrived), an aborted reservation's rows are held (``landing``), at most a
transfer timeout, and only then freed, so no late write lands in rows another request was given.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ringserve.v1 import common_pb2, disagg_pb2
from services.scheduler.disagg.roles import Role
from services.scheduler.executor.sampling import HostSample
from services.scheduler.policy.grammar import accept_grammar_tokens
from services.scheduler.policy.req import FinishReason, FinishType, Req

if TYPE_CHECKING:
    from services.scheduler.engine.engine import Engine


@dataclass(frozen=True)
class Handoff:
    """What the prefill side sends for one request (made in the engine thread).

    Attributes:
        rid: the request.
        bootstrap: the decode scheduler's gRPC address.
        src_rows: int64 [prompt_len] (host), this pool's rows of the prompt by position.
        commit: the first token and what came with it (transfer figures filled in by the sender).
    """

    rid: str
    bootstrap: str
    src_rows: torch.Tensor
    commit: disagg_pb2.KvCommit


@dataclass
class Reservation:
    """A decode-side request's slot and rows (int64 [prompt_len], by position), held since ``since``."""

    req: Req
    rows: torch.Tensor
    since: float
    peer_may_write: bool = False  # a one-sided engine's sender has the rows and has not said it is done


class DisaggState:
    """Both sides' requests in the middle of a handoff (see the module docstring).

    Args:
        engine: the engine this belongs to (its pools, stops and output).
        timeout_s: a reservation without a commit after this many seconds ends.
    """

    def __init__(self, engine: Engine, timeout_s: float = 30.0):
        self.engine = engine
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.waiting: deque[Req] = deque()  # decode side: for a slot and rows
        self.reserved: dict[str, Reservation] = {}  # decode side: for the commit
        self.sending: dict[str, Req] = {}  # prefill side: while the KV moves
        self.one_sided = False  # the peer writes into reserved rows without this side's lock
        self.landing: dict[str, tuple[torch.Tensor, float]] = {}  # decode side: aborted rows, since when
        self.on_handoff: Callable[[Handoff], None] = lambda handoff: None  # the sender (service)
        self.on_reserved: Callable[[str], None] = lambda rid: None  # wakes a waiting Reserve call
        self.transfer_bytes = 0  # decode side: bytes committed requests received
        self.transfer_seconds = 0.0
        self.num_transfers = 0

    @property
    def num_held(self) -> int:
        """Requests held that no step advances: they wait for room, a commit or a transfer."""
        return len(self.waiting) + len(self.reserved) + len(self.sending)

    # ---- decode side ---------------------------------------------------------------
    def reserve(self, req: Req) -> None:
        """Queue a decode-side request for its slot and rows (reserved now if they are free)."""
        self.waiting.append(req)
        self.poll()

    def poll(self) -> None:
        """Reserve for waiting requests in arrival order while room lasts; end reservations
        whose commit is overdue. Called before each step."""
        policy = self.engine.policy
        while self.waiting and policy.req_pool.available > 0:
            req = self.waiting[0]
            # As admission counts: the prompt plus a decode row for each running request.
            if req.prompt_len + len(policy.running) + 1 > policy.kv_room:
                break
            self.waiting.popleft()
            short = req.prompt_len - policy.kv_pool.available
            if short > 0 and policy.tree is not None:
                policy.tree.evict(short)
            rows = policy.kv_pool.alloc(req.prompt_len)
            req.req_slot = policy.req_pool.alloc()
            policy.req_pool.write(req.req_slot, 0, rows)
            with self.lock:
                self.reserved[req.rid] = Reservation(req, rows, time.monotonic())
            self.on_reserved(req.rid)
        overdue = time.monotonic() - self.timeout_s
        for rid in [rid for rid, (_, since) in self.landing.items() if since < overdue]:
            self.landed(rid)
        for res in [r for r in self.reserved.values() if r.since < overdue]:
            self.engine.abort(res.req.rid, message=f"the KV transfer did not finish within {self.timeout_s:g} s "
                              "(--disaggregation-transfer-timeout)", status="DEADLINE_EXCEEDED")

    def lend(self, rid: str) -> torch.Tensor | None:
        """The reserved rows of ``rid`` as the sender gets them (any thread): from now on, with a
        one-sided engine, the peer may write them until ``writer_done``. None when not reserved."""
        with self.lock:
            res = self.reserved.get(rid)
            if res is None:
                return None
            res.peer_may_write = self.one_sided
            return res.rows

    def writer_done(self, rid: str) -> None:
        """The sender of ``rid`` writes no more (engine thread): an aborted reservation's rows go
        back now, a live one's abort frees them at once."""
        with self.lock:
            if (res := self.reserved.get(rid)) is not None:
                res.peer_may_write = False
        self.landed(rid)

    def landed(self, rid: str) -> None:
        """No write into the aborted reservation of ``rid`` can land any more: free its rows."""
        if (held := self.landing.pop(rid, None)) is not None:
            self.engine.policy.kv_pool.free(held[0])

    def rows_of(self, rid: str) -> torch.Tensor | None:
        """The reserved rows of ``rid`` (any thread; hold ``lock`` while writing them); None when not reserved."""
        res = self.reserved.get(rid)
        return res.rows if res is not None else None

    def commit(self, msg: disagg_pb2.KvCommit) -> bool:
        """The KV of ``msg.rid`` is in: append its first token, emit its first row and run it.
        False when the rid holds no reservation (aborted meanwhile)."""
        with self.lock:
            res = self.reserved.pop(msg.rid, None)
        if res is None:
            self.landed(msg.rid)  # the sender is done writing
            return False
        engine, req = self.engine, res.req
        req.kv_len = req.prompt_len
        tree = engine.policy.tree
        req.last_node, req.tree_len = (tree.root if tree is not None else None), 0
        req.cached_tokens = msg.cached_tokens
        if msg.generator_state and req.generator is not None:
            req.generator.set_state(torch.frombuffer(bytearray(msg.generator_state), dtype=torch.uint8))
        if msg.HasField("prompt_logprobs"):
            p = msg.prompt_logprobs
            req.prompt_logprobs, req.prompt_top_ids, req.prompt_top_vals = list(p.logprobs), list(p.top_ids), \
                list(p.top_vals)
        req.prompt_logprob_pos = req.prompt_len  # computed: a re-prefill after retraction does not redo them
        req.append_output(msg.first_token)
        engine.stops.check([req])
        accept_grammar_tokens([req])
        out = engine._out  # this step's output: the first row goes with it
        out.add_row(req, [msg.first_token])
        if req.logprob_start_len is not None:
            out.add_prompt_logprobs(req)
        if req.return_logprob:
            out.add_logprobs(msg.logprob, list(msg.top_ids), list(msg.top_vals))
        self.num_transfers += 1
        self.transfer_bytes += msg.transfer_bytes
        self.transfer_seconds += msg.transfer_s
        if req.finished:
            engine._release(req)
        else:
            engine.policy.running.append(req)
        return True

    # ---- prefill side --------------------------------------------------------------
    def take_prefilled(self, live: list[tuple[int, Req]], result: HostSample) -> list[tuple[int, Req]]:
        """Hand over the prefill-side requests among ``live`` (row index, request) whose first
        token ``result`` holds; returns the other rows."""
        rest: list[tuple[int, Req]] = []
        for i, req in live:
            if req.disagg_role != Role.PREFILL:
                rest.append((i, req))
                continue
            token = result.next_ids[i]
            commit = disagg_pb2.KvCommit(rid=req.rid, first_token=token, cached_tokens=req.cached_tokens or 0)
            if req.return_logprob and result.logprobs is not None:
                commit.logprob = result.logprobs[i]
                k = req.top_logprobs_num
                if k and result.top_ids is not None and result.top_vals is not None:
                    commit.top_ids.extend(result.top_ids[i][:k])
                    commit.top_vals.extend(result.top_vals[i][:k])
            if req.logprob_start_len is not None:
                commit.prompt_logprobs.CopyFrom(common_pb2.PromptLogprobs(
                    start=max(1, req.logprob_start_len), logprobs=req.prompt_logprobs,
                    top_n=req.prompt_top_logprobs_num, top_ids=req.prompt_top_ids, top_vals=req.prompt_top_vals))
            if req.generator is not None:
                commit.generator_state = req.generator.get_state().numpy().tobytes()
            req.append_output(token)  # so that the prefix cache keeps the prompt on release
            if req in self.engine.policy.running:
                self.engine.policy.running.remove(req)  # it decodes elsewhere; its rows stay until sent
            assert req.req_slot is not None
            src = self.engine.req_pool.req_to_token[req.req_slot, : req.prompt_len].to(torch.int64)
            self.sending[req.rid] = req
            self.on_handoff(Handoff(req.rid, req.disagg_bootstrap, src, commit))
        return rest

    def handed(self, rid: str, error: str | None = None, status: str = "UNAVAILABLE") -> None:
        """The sender is done with ``rid``: release its rows into the prefix cache, or with
        ``error`` end it with a FINISH_ABORT row (``status``). A rid aborted meanwhile is gone already."""
        req = self.sending.pop(rid, None)
        if req is None:
            return
        if error is None:
            # Its part (one token) is done; the decode side reports the request's real end.
            req.finish_reason = FinishReason(FinishType.LENGTH)
            self.engine._release(req)
        else:
            self.engine.policy.release(req)
            del self.engine.reqs[rid]
            self.engine._emit_abort(req, error, status)

    # ---- both ------------------------------------------------------------------------
    def remove(self, req: Req) -> bool:
        """Abort: free what ``req`` holds here (reserved rows are freed, not cached); False
        when it is not in a handoff."""
        policy = self.engine.policy
        if req in self.waiting:
            self.waiting.remove(req)
            return True
        with self.lock:
            res = self.reserved.pop(req.rid, None)
        if res is not None:
            if res.peer_may_write:  # the peer may be writing them: freed once it cannot
                self.landing[req.rid] = (res.rows, time.monotonic())
            else:
                policy.kv_pool.free(res.rows)
            assert req.req_slot is not None
            policy.req_pool.free(req.req_slot)
            req.req_slot = None
            return True
        if self.sending.pop(req.rid, None) is not None:
            policy.release(req)  # the sender may still read the rows: they now hold cached KV, unchanged
            return True
        return False

    def clear(self) -> None:
        """Forget every handoff (after a failed step; the pools are rebuilt)."""
        self.waiting.clear()
        with self.lock:
            self.reserved.clear()
        self.sending.clear()
        self.landing.clear()
