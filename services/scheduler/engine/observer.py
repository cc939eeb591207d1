"""Hooks through which the engine reports request life-cycle events (metrics).

The engine calls them from its own thread: ``on_queued`` once per accepted request,
``on_step`` once per step that ran a plan (after the forward pass, before sampling),
``on_finish`` once per request that ends (any
finish reason, refusals included). The default does nothing; the service installs
``services.scheduler.metrics.SchedulerMetrics``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.policy.req import Req
    from services.scheduler.policy.schedule import Plan


class EngineObserver:
    """No-op hooks; see the module docstring for when each is called."""

    def on_queued(self, req: Req) -> None:
        """``req`` joined the waiting queue."""

    def on_step(self, plan: Plan, started: float) -> None:
        """The model ran ``plan``; its results are processed next. ``started`` is
        ``time.monotonic()`` taken before the plan was made."""

    def on_finish(self, req: Req) -> None:
        """``req`` ended (its ``finish_reason`` is set) and left the engine."""
