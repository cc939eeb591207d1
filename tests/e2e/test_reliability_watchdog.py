"""Watchdog: the scheduler's health turns NOT_SERVING while the engine thread has
work pending and makes no progress for ``--watchdog-timeout`` seconds, and SERVING again
once it moves.

A real engine cannot be made to hang on demand, so the engine loop here drives a stand-in
whose step blocks until released; the loop, the watchdog and the health setter are the
scheduler's own.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from services.scheduler.engine.loop import EngineLoop
from services.scheduler.main import Watchdog


class HangingEngine:
    """Has work; its first step blocks until ``release`` is set, later steps finish the work."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.steps = 0
        self.has_work = True
        self.only_compiling = False
        self.grammars = SimpleNamespace(wake=None)  # the loop installs its wake-up callback here
        self.cfg = SimpleNamespace(max_running_requests=1)

    def step(self) -> None:
        self.steps += 1
        if self.steps == 1:
            self.release.wait()
        else:
            self.has_work = False


async def test_watchdog_not_serving_while_stalled_serving_after():
    engine = HangingEngine()
    loop = EngineLoop(engine, on_output=lambda out: None)  # type: ignore[arg-type]
    health: list[bool] = []

    async def set_serving(serving: bool) -> None:
        health.append(serving)

    watchdog = Watchdog(loop.stalled_s, set_serving, timeout_s=0.3, ready=lambda: True)
    loop.start()
    try:
        await watchdog.check()
        assert health == []  # fresh: not stalled yet
        await asyncio.sleep(0.5)
        assert loop.stalled_s() >= 0.3
        await watchdog.check()
        assert health == [False]
        engine.release.set()
        for _ in range(100):
            if loop.stalled_s() == 0.0:
                break
            await asyncio.sleep(0.01)
        assert loop.stalled_s() == 0.0 and engine.steps == 2
        await watchdog.check()
        assert health == [False, True]
    finally:
        engine.release.set()
        loop.stop()


async def test_watchdog_ignores_an_idle_engine():
    engine = HangingEngine()
    engine.has_work = False
    loop = EngineLoop(engine, on_output=lambda out: None)  # type: ignore[arg-type]
    health: list[bool] = []

    async def set_serving(serving: bool) -> None:
        health.append(serving)

    loop.start()
    try:
        await asyncio.sleep(0.4)
        await Watchdog(loop.stalled_s, set_serving, timeout_s=0.3, ready=lambda: True).check()
        assert health == [] and loop.stalled_s() == 0.0 and engine.steps == 0
    finally:
        loop.stop()
