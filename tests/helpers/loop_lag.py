"""The event loop's lag while some work runs: how long a 1 ms sleep overshot, at worst."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def worst_lag_during(work: Awaitable[T]) -> tuple[T, float]:
    """(the result of ``work``, the loop's largest lag in seconds while it ran). A loop that
    runs ``work`` itself lags as long as the work; one that hands it to a thread barely at all."""
    lags: list[float] = []
    done = False

    async def tick() -> None:
        while not done:
            started = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - started - 0.001)

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0.01)
    try:
        result = await work
    finally:
        done = True
        await ticker
    return result, max(lags)
