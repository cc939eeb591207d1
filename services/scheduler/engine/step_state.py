"""What the engine hands across a step and to the wire: the launched step in flight (its rows,
the device ids and the wait for their copy to the host) and the load snapshot of GetLoad."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.scheduler.executor.sampling import HostSample
from services.scheduler.policy.req import Req
from services.scheduler.speculative.speculator import Verified


@dataclass(frozen=True)
class LoadStats:
    """A snapshot of the engine's occupancy and counters since start (the wire's LoadReport)."""

    num_running_reqs: int
    num_waiting_reqs: int
    req_slots_used: int
    kv_used_tokens: int  # held by requests (a cached prefix they lock included)
    kv_cached_tokens: int  # held only by the prefix cache: evictable, free for the taking
    kv_total_tokens: int
    num_decode_steps: int
    peak_decode_batch_size: int
    num_aborted_reqs: int
    num_finished_reqs: int
    schedule_policy: str = "fcfs"  # --schedule-policy: the tokenizer refuses a priority it cannot honour
    num_transfer_reqs: int = 0  # decode side: reservations waiting for their KV (services/scheduler/disagg)
    num_waiting_prompt_tokens: int = 0  # tokens the waiting queue's requests will prefill


@dataclass
class InFlight:
    """A launched step: the rows that sampled, their ids on the device, and the wait for
    the ids' copy to the host; the embeddings it ended and the wait for their copy."""

    reqs: list[Req]
    next_ids: torch.Tensor | None  # int64 [len(reqs)], device; None when no row samples
    rows: dict[Req, int]
    wait: Callable[[], HostSample] | None
    embedded: list[Req] = field(default_factory=list)  # embeddings whose prefill ended
    pooled: Callable[[], list[list[float]]] | None = None  # waits for their vectors' copy
    verified: dict[Req, Verified] = field(default_factory=dict)  # drafted rows (speculative decoding)


@dataclass(frozen=True)
class Emitted:
    """One token a row emits in a step, with its logprob and top logprobs (None / empty where not asked)."""

    token: int
    logprob: float | None
    top_ids: list[int]
    top_vals: list[float]


def emitted_run(result: HostSample, i: int, verified: Verified | None) -> list[Emitted]:
    """The tokens row ``i`` of a step emits, in order: its sampled token; for a drafted row
    (speculative decoding) the drafts it kept, then the replacement of the first rejected
    one, or, all kept, its sampled token (the bonus)."""
    sampled = Emitted(result.next_ids[i], result.logprobs[i] if result.logprobs is not None else None,
                      result.top_ids[i] if result.top_ids is not None else [],
                      result.top_vals[i] if result.top_vals is not None else [])
    if verified is None:
        return [sampled]
    kept = verified.kept
    run = [Emitted(tok, lp, ids, vals) for _, tok, lp, ids, vals in verified.positions[: kept + 1]]
    return run if kept < len(verified.drafts) else run + [sampled]


def reads_output_history(req: Req) -> bool:
    """Sampling this request's next token reads its output so far on the host (penalties,
    min tokens, a grammar's matcher)."""
    return penalised(req) or req.grammar is not None


def penalised(req: Req) -> bool:
    """This request's logits depend on its output so far: penalties, or min tokens not reached."""
    p = req.sampling
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                or len(req.output_ids) < p.min_new_tokens)
