"""``SchedulePolicy`` on a small KV pool with a fake model runner: the scheduling policy tested
as plain Python, no model (vLLM's ``create_scheduler`` and hand-made ``ModelRunnerOutput``).

``create_policy`` builds the policy over one-layer pools of one float per token, so a pool
of a few dozen tokens costs nothing. ``FakeRunner`` plays the engine's part of a step
(``Engine._launch`` / ``_finish``) without logits: every planned request's ``kv_len``
advances by its extend length; every row that ends its prefill or decodes samples one
token; a request with ``max_new_tokens`` outputs is released. The sampled token is a
function of the request's tokens so far (``position_token`` by default), so a retracted
request resumes with the tokens it would have had, as greedy decoding does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.scheduler.policy.kv_pool import ReqToTokenPool, TokenToKVPool
from services.scheduler.policy.radix_cache import RadixCache
from services.scheduler.policy.req import Req, ReqInput, SamplingParams
from services.scheduler.policy.schedule import Plan, SchedulePolicy


def create_policy(kv_tokens: int = 64, max_running: int = 4, max_prefill_tokens: int = 16384,
                  chunked_prefill_size: int = 0, radix: bool = True, policy: str = "fcfs",
                  max_context: int = 256) -> SchedulePolicy:
    """A SchedulePolicy over a ``kv_tokens``-row KV pool (one layer, one float per token),
    ``max_running`` req slots of ``max_context`` positions, and a prefix cache unless ``radix``
    is False."""
    kv_pool = TokenToKVPool(kv_tokens, num_layers=1, kv_heads=1, head_dim=1, dtype=torch.float32)
    req_pool = ReqToTokenPool(max_running, max_context, pad_row=kv_pool.pad_row)
    tree = RadixCache(kv_pool) if radix else None
    return SchedulePolicy(req_pool, kv_pool, max_running, max_prefill_tokens, chunked_prefill_size, tree, policy)


def make_req(rid: str, prompt: list[int], max_new_tokens: int = 4, priority: int = 0) -> Req:
    """A request with prompt ``prompt`` that ends after ``max_new_tokens`` outputs."""
    return Req(ReqInput(rid=rid, input_ids=prompt, sampling=SamplingParams(max_new_tokens=max_new_tokens),
                        priority=priority))


def position_token(req: Req) -> int:
    """The default fake sample: 1000 + the position it takes."""
    return 1000 + req.seq_len


@dataclass(frozen=True)
class StepRecord:
    """One step as the tests read it: the plan's rows and what each sampled."""

    rids: list[str]
    prefix_lens: list[int]
    extend_lens: list[int]
    num_extend: int
    sampled: dict[str, int]


class FakeRunner:
    """Steps ``policy`` as the engine does, sampling ``next_token(req)`` instead of running a model.

    ``finished`` holds each released request's output; ``steps`` a ``StepRecord`` per plan run.
    """

    def __init__(self, policy: SchedulePolicy, next_token: Callable[[Req], int] = position_token):
        self.policy = policy
        self.next_token = next_token
        self.finished: dict[str, list[int]] = {}
        self.steps: list[StepRecord] = []

    def add(self, *reqs: Req) -> None:
        self.policy.waiting.extend(reqs)

    def step(self, skip: frozenset[Req] = frozenset()) -> StepRecord | None:
        """Plan and run one step; None when the policy has nothing to run.

        Raises:
            AssertionError: the plan's KV rows do not match its extend lengths.
        """
        plan = self.policy.schedule(skip)
        if plan is None:
            return None
        assert plan.out_cache_loc.numel() == sum(plan.extend_lens)
        record = StepRecord([r.rid for r in plan.reqs], list(plan.prefix_lens), list(plan.extend_lens),
                            plan.num_extend, self._run(plan))
        self.steps.append(record)
        return record

    def run(self, max_steps: int = 1000) -> list[StepRecord]:
        """Step until the policy has nothing to run; the steps taken."""
        taken = []
        while len(taken) < max_steps and (record := self.step()) is not None:
            taken.append(record)
        return taken

    def _run(self, plan: Plan) -> dict[str, int]:
        for req, n in zip(plan.reqs, plan.extend_lens, strict=True):
            req.kv_len += n
        sampled = {}
        for req in plan.reqs:
            if req is self.policy.chunked:  # a chunk short of the prompt's end samples nothing
                continue
            token = self.next_token(req)
            req.append_output(token)
            sampled[req.rid] = token
            if len(req.output_ids) >= req.sampling.max_new_tokens:
                self.finished[req.rid] = list(req.output_ids)
                self.policy.remove(req)
        return sampled
