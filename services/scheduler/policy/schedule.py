"""Scheduling policy: which requests extend (prefill) and which decode in the next step.

Continuous batching as in SGLang's scheduler and vLLM v1's, with SGLang's mixed chunked
prefill: every step decodes one token for each running request and, in the same forward
pass, extends the waiting requests that fit (the extend rows first, the decode rows
after them; the model runs the linear layers over all tokens at once and attention per
part). A prompt longer than the step's token budget (``chunked_prefill_size``) is
prefilled a chunk per step, so a long prompt delays the running streams by one chunk's
compute per token, not by its whole prefill. The token budget of a step is
``min(max_prefill_tokens, chunked_prefill_size)``; without chunking a single request
longer than the budget still runs alone.

Admission: waiting requests are taken in ``fcfs`` order, ``lpm`` (longest cached prefix
first, SGLang's policy of that name), or ``priority`` (by the request's priority, lower
first, then arrival: ``policy.waiting``), while the KV pool -- free rows plus rows the
prefix cache may evict -- holds their whole remaining prompt plus one decode token per
running request. The prefix cache supplies the longest cached prefix of prompt + output
so far, except the last token, which is always recomputed to get its logits.

Retraction: when the pool cannot hold the next decode token of every running request,
one is retracted: under ``priority`` the one of the largest priority value; among equals
(every request, under the other policies) the one with the least progress (a partially
prefilled one first, then fewest output tokens, then the newest). Its computed tokens go
to the prefix cache (or are freed without one), its req slot is freed and it waits to be
prefilled again with prompt + output so far (SGLang's ``retract_decode``): first in line,
or under ``priority`` in its priority place. Greedy output is unchanged by this.

Preemption (``priority`` only, as vLLM's priority policy): when the head of the queue has
a request slot but its prompt does not fit the KV pool, running requests of a larger
priority value than its own are retracted, in retraction order, until it fits -- but only
when retracting all of them would make room, and not while a prompt is being chunk-
prefilled (the head waits for that chunk's end, a few steps). A full batch of request slots
is not preempted: the head takes the next slot that frees. Equal priorities never preempt
each other, so a retracted request cannot retract its retractor in turn.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ringserve.priority import PRIORITY_POLICY
from services.scheduler.config import SCHEDULE_POLICIES
from services.scheduler.policy.kv_pool import ReqToTokenPool, TokenToKVPool
from services.scheduler.policy.radix_cache import RadixCache, TreeNode
from services.scheduler.policy.req import Req
from services.scheduler.policy.waiting import WaitingQueue

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from services.scheduler.executor.pooling import PoolRows

# Beyond this many waiting requests lpm orders first-come-first-served: matching every
# waiting prompt each step would cost more than it saves (SGLang uses the same cut-off).
_LPM_MAX_QUEUE = 128


@dataclass
class Plan:
    """What one step runs.

    Attributes:
        reqs: the batch in row order: ``num_extend`` extend requests, then decode requests.
        prefix_lens: per request, tokens already in the KV cache.
        extend_lens: per request, tokens computed this step (1 for each decode request).
        out_cache_loc: int64 [sum(extend_lens)], KV pool rows for the new tokens.
        num_extend: how many of ``reqs`` extend; the rest decode.
        logprob_rows: int64 [R], packed extend token indices whose hidden states the model
            runner keeps in ``logprob_hidden`` ([R, hidden]) for prompt logprobs
            (executor/prompt_logprobs.py); None when no request asks.
        pool: the extend rows embedding requests pool (executor/pooling.py), whose pooled
            sums the model runner leaves in ``pooled`` (float32 [E, hidden]); None: none.
        drafts: per extend request, the draft tokens that follow its newest token (speculative
            decoding: the row extends newest + drafts; empty for a prompt's extend); [] when
            no row has drafts.
    """

    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor
    num_extend: int
    logprob_rows: torch.Tensor | None = None
    logprob_hidden: torch.Tensor | None = None
    pool: PoolRows | None = None
    pooled: torch.Tensor | None = None
    drafts: list[list[int]] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        """Every request decodes (no extend part)."""
        return self.num_extend == 0

    @property
    def num_drafted(self) -> int:
        """Decoding requests that verify drafts this step (``drafts``)."""
        return sum(1 for d in self.drafts if d)


class SchedulePolicy:
    """Owns the waiting queue, the running batch and the request being chunk-prefilled;
    allocates req slots and KV rows for each plan.

    Args:
        chunked_prefill_size: most prompt tokens one step extends; <= 0 disables chunking.
        tree: the prefix cache, or None to run without one.
        policy: admission order, one of ``SCHEDULE_POLICIES``.
    """

    def __init__(self, req_pool: ReqToTokenPool, kv_pool: TokenToKVPool, max_running: int, max_prefill_tokens: int,
                 chunked_prefill_size: int = 0, tree: RadixCache | None = None, policy: str = "fcfs"):
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}; supported: {SCHEDULE_POLICIES}")
        self.req_pool = req_pool
        self.kv_pool = kv_pool
        self.tree = tree
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.chunked_prefill_size = chunked_prefill_size
        self.policy = policy
        self.by_priority = policy == PRIORITY_POLICY
        self.waiting = WaitingQueue(self.by_priority)
        self.running: list[Req] = []
        self.chunked: Req | None = None  # holds a req slot and part of its prompt's KV
        self.num_retracted = 0

    # ---- memory ------------------------------------------------------------------------
    @property
    def kv_room(self) -> int:
        """KV rows a plan can take: free rows plus rows the prefix cache can evict."""
        return self.kv_pool.available + self.kv_cached

    @property
    def kv_cached(self) -> int:
        """Rows held only by the prefix cache (evictable)."""
        return self.tree.evictable_size if self.tree else 0

    def alloc_kv(self, n: int) -> torch.Tensor:
        """``n`` KV rows, evicting from the prefix cache what the free list lacks (see ``kv_room``)."""
        return self._alloc_kv(n)

    def _alloc_kv(self, n: int) -> torch.Tensor:
        short = n - self.kv_pool.available
        if short > 0 and self.tree is not None:
            self.tree.evict(short)
        return self.kv_pool.alloc(n)

    # ---- planning ----------------------------------------------------------------------
    def schedule(self, skip: frozenset[Req] = frozenset()) -> Plan | None:
        """Next plan: this step's extend part (if any request fits) plus a decode token for
        every running request not in ``skip`` (under overlap scheduling: requests the step
        in flight ends by length); None when there is nothing to run."""
        retracted = self._make_decode_room()
        if not retracted and self.by_priority:
            self._preempt_for_head(skip)
        decode = [r for r in self.running if r not in skip] if skip else list(self.running)
        ext_reqs, prefix_lens, ext_lens, ext_rows = self._schedule_extend(len(decode), admit=not retracted)
        if not ext_reqs and not decode:
            return None
        rows = self._alloc_kv(len(decode))
        if decode:
            self.req_pool.write_batch([r.req_slot for r in decode], [r.kv_len for r in decode], rows)
        return Plan(ext_reqs + decode, prefix_lens + [r.kv_len for r in decode], ext_lens + [1] * len(decode),
                    torch.cat((ext_rows, rows)), len(ext_reqs))

    def _make_decode_room(self) -> bool:
        """Retract until every running request (and a chunked prefill) has a row for its
        next token; True when any request was retracted."""
        retracted = False
        while (need := len(self.running) + (self.chunked is not None)) > self.kv_room and need > 1:
            chunked = [self.chunked] if self.chunked is not None else []
            victim = min(chunked + self.running[::-1], key=self._retract_order)
            self._retract(victim, "KV room for the running requests' next tokens")
            retracted = True
        return retracted

    def _retract_order(self, req: Req) -> tuple[int, int]:
        """Retraction's key, the first (smallest) retracted first: under priority the largest
        priority value; then least progress (chunk-prefilling, then fewest output tokens).
        Callers list candidates newest first, so ``min`` takes the newest among equals."""
        progress = -1 if req is self.chunked else len(req.output_ids)
        return (-req.priority if self.by_priority else 0), progress

    def _preempt_for_head(self, skip: frozenset[Req]) -> bool:
        """Retract running requests of a larger priority value than the head of the queue
        until its prompt fits the KV pool (the module docstring); True when any was retracted."""
        if not self.waiting or self.chunked is not None:
            return False
        if len(self.running) >= self.max_running or self.req_pool.available == 0:
            return False  # a full batch is not preempted: the head takes the next free slot
        head = self.waiting[0]
        victims = sorted((r for r in self.running[::-1] if r.priority > head.priority and r not in skip),
                         key=self._retract_order)
        if not victims or self._kv_fits(head, skip) or not self._kv_fits(head, skip, victims):
            return False  # it fits already, or retracting them all would not make room: retract none
        for victim in victims:
            self._retract(victim, f"request {head.rid} of priority {head.priority}")
            if self._kv_fits(head, skip):
                break
        return True

    def _kv_fits(self, req: Req, skip: frozenset[Req], gone: list[Req] | None = None) -> bool:
        """Whether the KV pool holds ``req``'s remaining prompt plus a decode row per running
        request not in ``skip``, as admission counts -- with ``gone`` retracted: at best (all
        their rows freed; rows they share with other requests stay held)."""
        gone = gone or []
        num_decode = sum(r not in skip for r in self.running) - len(gone)
        cached, node = self._match(req)
        if self.tree is not None:
            self.tree.inc_lock_ref(node)  # as admission does: its own cached prefix is not room
        room = self.kv_room + sum(r.kv_len for r in gone)
        if self.tree is not None:
            self.tree.dec_lock_ref(node)
        return req.seq_len - len(cached) + num_decode + 1 <= room

    def _schedule_extend(self, num_decode: int, admit: bool) -> tuple[list[Req], list[int], list[int], torch.Tensor]:
        batch: list[Req] = []
        prefix_lens: list[int] = []
        ext_lens: list[int] = []
        rows: list[torch.Tensor] = []
        chunking = self.chunked_prefill_size > 0
        budget = min(self.max_prefill_tokens, self.chunked_prefill_size) if chunking else self.max_prefill_tokens
        reserved = num_decode  # one decode row per running request

        if self.chunked is not None:
            req, self.chunked = self.chunked, None
            n = min(req.seq_len - req.kv_len, budget, self.kv_room - reserved)
            if n > 0:
                self._extend_into(req, batch, prefix_lens, ext_lens, rows, n)
                budget -= n
                reserved += 1
            else:
                self.chunked = req

        if admit and self.policy == "lpm" and self.tree is not None and 1 < len(self.waiting) <= _LPM_MAX_QUEUE:
            self.waiting.reorder(lambda r: -len(self._match(r)[0]))
        while (admit and self.waiting and self.chunked is None and budget > 0
               and len(self.running) < self.max_running and self.req_pool.available > 0):
            req = self.waiting[0]
            cached, node = self._match(req)
            remaining = req.seq_len - len(cached)
            if batch and not chunking and remaining > budget:
                break
            if self.tree is not None:
                self.tree.inc_lock_ref(node)
            if remaining + reserved + 1 > self.kv_room:
                if self.tree is not None:
                    self.tree.dec_lock_ref(node)
                break
            self.waiting.popleft()
            req.req_slot = self.req_pool.alloc()
            req.kv_len = len(cached)
            req.last_node, req.tree_len = node, len(cached)
            if req.cached_tokens is None:
                req.cached_tokens = len(cached)
            if len(cached):
                self.req_pool.write(req.req_slot, 0, cached)
            n = min(remaining, budget) if chunking else remaining
            self._extend_into(req, batch, prefix_lens, ext_lens, rows, n)
            budget -= n
            reserved += 1
        out_rows = torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64)
        return batch, prefix_lens, ext_lens, out_rows

    def _extend_into(self, req: Req, batch: list[Req], prefix_lens: list[int], ext_lens: list[int],
                     rows: list[torch.Tensor], n: int) -> None:
        """Plan ``n`` more tokens of ``req``'s prefill; it runs after this step unless more remain."""
        new = self._alloc_kv(n)
        self.req_pool.write(req.req_slot, req.kv_len, new)
        batch.append(req)
        prefix_lens.append(req.kv_len)
        ext_lens.append(n)
        rows.append(new)
        if req.kv_len + n < req.seq_len:
            self.chunked = req
        else:
            self.running.append(req)

    def _match(self, req: Req) -> tuple[torch.Tensor, TreeNode | None]:
        """Cached prefix of prompt + output except the last token -> (KV rows, tree node).

        A request that still needs prompt logprobs takes from the cache only the positions
        before the first one it scores (executor/prompt_logprobs.py), and an embedding only
        those before the first one it pools (executor/pooling.py): those are recomputed.
        """
        if self.tree is None:
            return torch.empty(0, dtype=torch.int64), None
        ids = req.cache_ids()
        end = len(ids) - 1
        if req.prompt_logprob_pos < req.prompt_len:
            end = min(end, req.prompt_logprob_pos - 1)
        if req.pool_from is not None:  # an embedding pools the hidden states from there on
            end = min(end, req.pool_from)
        return self.tree.match_prefix(ids[:end])

    # ---- releasing memory ----------------------------------------------------------------
    def _retract(self, req: Req, why: str) -> None:
        """Take ``req`` out of the running batch (or its chunked prefill), release its memory and
        queue it again (``WaitingQueue.requeue``); ``why`` says for what, in the log line."""
        if req is self.chunked:
            self.chunked = None
        else:
            self.running.remove(req)
        log.info("retracted request %s (priority %d, %d output tokens) for %s", req.rid, req.priority,
                 len(req.output_ids), why)
        self.release(req)
        self.waiting.requeue(req)
        self.num_retracted += 1

    def release(self, req: Req) -> None:
        """Return a request's KV rows and req slot; with a prefix cache its computed tokens
        are cached instead of freed (no-op if it holds none)."""
        if req.req_slot is None:
            return
        kv = self.req_pool.req_to_token[req.req_slot, : req.kv_len].to(torch.int64)
        if self.tree is None:
            self.kv_pool.free(kv)
        else:
            # Under overlap scheduling a request can hold the row of a step planned after
            # its last token was sampled (kv_len == seq_len): that row is freed, not cached,
            # so the cache holds what it would without overlap.
            n = min(req.kv_len, req.seq_len - 1)
            # Rows the tree already held for tokens this request computed itself are duplicates.
            kept = self.tree.insert(req.cache_ids()[:n], kv[:n])
            self.kv_pool.free(torch.cat((kv[req.tree_len : kept], kv[n:])))
            self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.tree_len = None, 0
        self.req_pool.free(req.req_slot)
        req.req_slot = None
        req.kv_len = 0

    def remove(self, req: Req) -> None:
        """Drop a request from whichever queue holds it and release its memory."""
        if req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.release(req)

    def reset(self) -> None:
        """Forget every request and rebuild both pools and the prefix cache (after a failed step)."""
        self.waiting.clear()
        self.running.clear()
        self.chunked = None
        self.req_pool.reset()
        self.kv_pool.reset()
        if self.tree is not None:
            self.tree.reset()
