"""Scheduling policy: each step is one extend (prefill) batch or one decode batch.

Continuous batching as in SGLang's scheduler and vLLM v1's: a request that arrives while
others decode is prefilled at the next step and joins the running decode batch after it.
Extend batches take waiting requests first-come-first-served under a token budget
(``max_prefill_tokens``; a single request longer than the budget still runs alone);
admission keeps one KV token per running request free so decode can proceed. When the KV
pool cannot hold the next decode token of every running request, the newest requests are
retracted: their KV cache and req slot are freed and they wait to be prefilled again with
prompt + output so far (SGLang's ``retract_decode``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from services.scheduler.engine.kv_pool import ReqToTokenPool, TokenToKVPool
from services.scheduler.engine.req import Req


@dataclass
class Plan:
    """What one step runs.

    Attributes:
        is_decode: decode batch (one new token per request) or extend batch.
        reqs: the batch, in row order.
        prefix_lens: per request, tokens already in the KV cache (extend; 0 without a prefix cache).
        extend_lens: per request, tokens computed this step (1 each for decode).
        out_cache_loc: int64 [sum(extend_lens)], KV pool rows for the new tokens.
    """

    is_decode: bool
    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor


class SchedulePolicy:
    """Owns the waiting queue and the running batch; allocates req slots and KV rows for a plan."""

    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool, max_running: int, max_prefill_tokens: int):
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_retracted = 0

    def schedule(self) -> Plan | None:
        """Next plan: extend if any waiting request fits, else decode the running batch, else None."""
        if self.waiting:
            plan = self._schedule_extend()
            if plan is not None:
                return plan
        if self.running:
            return self._schedule_decode()
        return None

    def _schedule_extend(self) -> Plan | None:
        batch: list[Req] = []
        budget = self.max_prefill_tokens
        kv_free = self.kv_pool.available - len(self.running)  # decode headroom
        while self.waiting and len(self.running) + len(batch) < self.max_running and self.req_pool.available > len(batch):
            n = self.waiting[0].seq_len
            if batch and n > budget:
                break
            if n + 1 > kv_free:
                break
            batch.append(self.waiting.popleft())
            budget -= n
            kv_free -= n + 1
        if not batch:
            return None
        lens = [r.seq_len for r in batch]
        rows = self.kv_pool.alloc(sum(lens))
        start = 0
        for req, n in zip(batch, lens):
            req.req_slot = self.req_pool.alloc()
            self.req_pool.req_to_token[req.req_slot, :n] = rows[start : start + n].to(torch.int32)
            start += n
        self.running.extend(batch)
        return Plan(False, batch, [0] * len(batch), lens, rows)

    def _schedule_decode(self) -> Plan:
        while self.kv_pool.available < len(self.running) and len(self.running) > 1:
            self.retract(self.running[-1])
        reqs = list(self.running)
        rows = self.kv_pool.alloc(len(reqs))
        slots = torch.tensor([r.req_slot for r in reqs], dtype=torch.int64)
        positions = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        self.req_pool.req_to_token[slots, positions] = rows.to(torch.int32)
        return Plan(True, reqs, [r.kv_len for r in reqs], [1] * len(reqs), rows)

    def retract(self, req: Req) -> None:
        """Free a running request's KV cache and req slot and put it first in the waiting queue."""
        self.running.remove(req)
        self.release(req)
        self.waiting.appendleft(req)
        self.num_retracted += 1

    def release(self, req: Req) -> None:
        """Return a request's KV rows and req slot to their pools (no-op if it holds none)."""
        if req.req_slot is None:
            return
        self.kv_pool.free(self.req_pool.req_to_token[req.req_slot, : req.kv_len].clone())
        self.req_pool.free(req.req_slot)
        req.req_slot = None
        req.kv_len = 0

    def remove(self, req: Req) -> None:
        """Drop a request from whichever queue holds it and release its memory."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.release(req)
