"""Scheduler configuration: frozen dataclasses, parsed once from flags in ``main``.

Every flag is a field declared in the option table (``ringserve.options.scheduler``), with
its default, help and choices; these subclasses add what no flag sets and the derived values.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# policy.schedule imports the policy names from here.
from ringserve.options.names import SCHEDULE_POLICIES  # noqa: F401
from ringserve.options.scheduler import EngineOptions, SchedulerOptions


@dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineOptions):
    """What the engine needs; gRPC-free. The fields and their meaning: ``EngineOptions``."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(SchedulerOptions):
    """The service: where it listens, where the detokenizer is, and its engine (fields:
    ``SchedulerOptions``)."""

    engine: EngineConfig
    load_report_interval_s: float = 1.0  # how often the scheduler reports its load to each tokenizer

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model).name

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
