"""What the engine hands across a step and to the wire: the launched step in flight (its rows,
the device ids and the wait for their copy to the host) and the load snapshot of GetLoad."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.scheduler.executor.sampling import HostSample
from services.scheduler.policy.req import Req


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


def reads_output_history(req: Req) -> bool:
    """Sampling this request's next token reads its output so far on the host (penalties,
    min tokens, a grammar's matcher)."""
    p = req.sampling
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                or len(req.output_ids) < p.min_new_tokens or req.grammar is not None)
