"""The engine-thread state of both sides of a disaggregated request.

Decode side: a request whose part is ``Role.DECODE`` waits in ``waiting`` until a request slot
and KV rows for its whole prompt are free (backpressure: the prefill side's ``Reserve`` call
waits with it, so a transfer never lands in a full pool), then holds them in ``reserved`` until
the prefill side commits: its first token is appended, stops are checked, its first row goes to
the detokenizer and it joins the running batch with ``kv_len`` = prompt length. An abort before
the commit frees the reserved rows without caching them (they hold no valid KV); a reservation
that no commit follows within ``timeout_s`` ends with DEADLINE_EXCEEDED.

Prefill side: a request whose part is ``Role.PREFILL`` runs its prompt as any other (chunked
prefill, prefix cache). The engine calls two seams around each step's forward pass: ``admitted``
(before it: the sender opens the handoff, ``on_open``, so the decode side's ``Reserve`` runs
while the first chunk computes) and ``extended`` (after it: each chunk short of the prompt's end
hands the sender that chunk's rows, ``on_range``, to move while the next chunk computes). In the
step that samples its first token it leaves the running batch without a row for the
detokenizer, keeps its slot and rows while the sender moves the rest (``on_handoff``: the last
range and the commit; ``sending``), and on ``handed`` releases them into its own prefix cache --
or, when the transfer failed, ends with a FINISH_ABORT row that names why. An abort in between
tells the sender to stop (``on_cancel``) between its pieces.

The decode side counts the rows written into each reservation (every layer of every position,
``Reservation.written``) and refuses a commit short of the prompt (``ShortCommit``).

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
from services.scheduler.disagg.transfer import KvLayout, KvTransfer
from services.scheduler.executor.sampling import HostSample
from services.scheduler.policy.grammar import accept_grammar_tokens
from services.scheduler.policy.req import FinishReason, FinishType, Req

if TYPE_CHECKING:
    from services.scheduler.engine.engine import Engine
    from services.scheduler.policy.schedule import Plan


@dataclass(frozen=True)
class Handoff:
    """What the prefill side sends for one request once its first token is sampled (made in the
    engine thread).

    Attributes:
        rid: the request.
        bootstrap: the decode scheduler's gRPC address.
        src_rows: int64 [prompt_len] (host), this pool's rows of the prompt by position.
        commit: the first token and what came with it (transfer figures filled in by the sender).
        start: positions before it went to the sender already, chunk by chunk (``on_range``):
            the last range is ``src_rows[start:]``.
    """

    rid: str
    bootstrap: str
    src_rows: torch.Tensor
    commit: disagg_pb2.KvCommit
    start: int = 0


class ShortCommit(ValueError):
    """A commit came before every row of the prompt was written into its reservation."""


@dataclass
class Reservation:
    """A decode-side request's slot and rows (int64 [prompt_len], by position), held since
    ``since``; ``written`` (bool [num_layers, prompt_len]) marks the rows written so far."""

    req: Req
    rows: torch.Tensor
    since: float
    written: torch.Tensor
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
        self.row_bytes = KvLayout.of(engine.kv_pool).row_bytes
        self.waiting: deque[Req] = deque()  # decode side: for a slot and rows
        self.reserved: dict[str, Reservation] = {}  # decode side: for the commit
        self.sending: dict[str, Req] = {}  # prefill side: while the KV moves
        self.one_sided = False  # the peer writes into reserved rows without this side's lock
        self.landing: dict[str, tuple[torch.Tensor, float]] = {}  # decode side: aborted rows, since when
        self.on_handoff: Callable[[Handoff], None] = lambda handoff: None  # the sender (service)
        self.on_open: Callable[[str, str, int], None] = lambda rid, bootstrap, num_tokens: None
        self.on_range: Callable[[str, int, torch.Tensor], None] = lambda rid, start, src_rows: None
        self.on_cancel: Callable[[str], None] = lambda rid: None
        self.ranged: dict[str, int] = {}  # prefill side: positions handed to the sender so far, by rid
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
            written = torch.zeros(len(self.engine.kv_pool.k_buffer), req.prompt_len, dtype=torch.bool)
            with self.lock:
                self.reserved[req.rid] = Reservation(req, rows, time.monotonic(), written)
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

    def receive(self, transfer: KvTransfer, chunk: disagg_pb2.KvChunk) -> int:
        """Write one streamed piece into its reservation and count its rows (any thread; takes
        ``lock``, so an abort never frees rows a piece is landing in). Returns its bytes, -1
        when the rid holds no reservation.

        Raises:
            ValueError: the piece does not fit the reservation or the layout.
        """
        with self.lock:
            res = self.reserved.get(chunk.rid)
            if res is None:
                return -1
            n = transfer.receive(self.engine.kv_pool, res.rows, chunk)  # checks the piece fits
            res.written[chunk.layer, chunk.start : chunk.start + len(chunk.k) // self.row_bytes] = True
            return n

    def wrote(self, rid: str, start: int, num_tokens: int) -> bool:
        """A one-sided engine's sender reports positions [start, start + num_tokens) of every
        layer written (any thread); False when the rid holds no reservation.

        Raises:
            ValueError: the positions are outside the reservation.
        """
        with self.lock:
            res = self.reserved.get(rid)
            if res is None:
                return False
            if start < 0 or start + num_tokens > res.rows.numel():
                raise ValueError(f"KV positions {start}..{start + num_tokens - 1} are outside the "
                                 f"{res.rows.numel()} reserved rows")
            res.written[:, start : start + num_tokens] = True
            return True

    def commit(self, msg: disagg_pb2.KvCommit) -> bool:
        """The KV of ``msg.rid`` is in: append its first token, emit its first row and run it.
        False when the rid holds no reservation (aborted meanwhile).

        Raises:
            ShortCommit: not every row of the prompt was written (the reservation stays).
        """
        with self.lock:
            res = self.reserved.get(msg.rid)
            if res is not None and not bool(res.written.all()):
                missing = int((~res.written).sum())
                raise ShortCommit(f"the commit of {msg.rid!r} came with {missing} of its "
                                  f"{res.written.numel()} KV rows (layers x prompt positions) not written")
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
    def admitted(self, plan: Plan) -> None:
        """Before a step's forward pass: open the handoff of each prefill-side request whose
        prompt the plan starts, so the decode side's reservation comes back while it computes."""
        for req in plan.reqs[: plan.num_extend]:
            # One that only scores its prompt samples no token: nothing to hand over.
            if req.disagg_role == Role.PREFILL and req.rid not in self.ranged and req.sampling.max_new_tokens > 0:
                self.ranged[req.rid] = 0
                self.on_open(req.rid, req.disagg_bootstrap, req.prompt_len)

    def extended(self, plan: Plan) -> None:
        """After a step's forward pass (``kv_len`` advanced): hand the sender the rows of each
        prefill-side chunk short of the prompt's end -- from the first position not handed on
        yet, so a prefix-cache hit goes with the first chunk -- to move while the next computes.
        The last chunk's rows go with the handoff (``take_prefilled``). A request prefilled
        again after a retraction hands on every row again: its rows may have moved."""
        for req, n in zip(plan.reqs[: plan.num_extend], plan.extend_lens, strict=False):
            first = self.ranged.get(req.rid)
            if first is None or req.disagg_role != Role.PREFILL:
                continue
            if req.kv_len - n < first:  # this chunk recomputes positions handed on already
                first = 0
            end = min(req.kv_len, req.prompt_len)
            if end < req.prompt_len and end > first:
                assert req.req_slot is not None
                rows = self.engine.req_pool.req_to_token[req.req_slot, first:end].to(torch.int64)
                self.on_range(req.rid, first, rows)
                first = end
            self.ranged[req.rid] = first

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
            self.on_handoff(Handoff(req.rid, req.disagg_bootstrap, src, commit, self.ranged.pop(req.rid, 0)))
        return rest

    def handed(self, rid: str, error: str | None = None, status: str = "UNAVAILABLE") -> None:
        """The sender is done with ``rid``: release its rows into the prefix cache, or with
        ``error`` end it with a FINISH_ABORT row (``status``) -- at once, when it still computes
        its prompt (the handoff failed before its first token). A rid aborted meanwhile is gone
        already."""
        if error is not None:
            self.on_cancel(rid)  # the sender forgets it: nothing more comes for it
        req = self.sending.pop(rid, None)
        if req is None:
            if error is not None and rid in self.ranged:
                self.engine.abort(rid, message=error, status=status)
            return
        self.ranged.pop(rid, None)
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
        if self.ranged.pop(req.rid, None) is not None or req.rid in self.sending:
            self.on_cancel(req.rid)  # its sender stops between ranges
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
        """Forget every handoff (after a failed step; the pools are rebuilt); their senders stop."""
        for rid in {*self.ranged, *self.sending}:
            self.on_cancel(rid)
        self.ranged.clear()
        self.waiting.clear()
        with self.lock:
            self.reserved.clear()
        self.sending.clear()
        self.landing.clear()
