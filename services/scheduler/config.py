"""Scheduler configuration: frozen dataclasses, parsed once from flags in ``main``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs; gRPC-free.

    Attributes:
        max_total_tokens: KV pool size in tokens. 65536 by default: for SmolLM2-135M in fp32
            a token's K and V over 30 layers take 46 KiB, so the full pool is 3 GiB of
            address space, committed only as tokens are first written.
        max_prefill_tokens: token budget of one extend batch.
        context_length: None = the model's max_position_embeddings.
        seed: seed of the shared generator for unseeded requests; None = nondeterministic.
    """

    model: Path
    dtype: str = "float32"
    max_running_requests: int = 64
    max_total_tokens: int = 65536
    max_prefill_tokens: int = 8192
    context_length: int | None = None
    seed: int | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    """The service: where it listens, where the detokenizer is, and its engine."""

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 30020
    detokenizer: str = "127.0.0.1:30030"
    instance_id: str = "scheduler-0"
    load_report_interval_s: float = 1.0
    torch_threads: int | None = field(default=None)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
