"""The waiting queue: the requests that wait for a request slot and KV room, in admission order.

- ``fcfs`` and ``lpm`` (which reorders the queue each step by cached prefix,
  ``policy.schedule``): arrival order, a retracted request first in line (SGLang's
  ``retract_decode``).
- ``priority``: ordered by (priority, arrival), lower first, as vLLM's priority policy
  orders its waiting queue; a retracted request keeps its arrival number, so it goes back
  to its priority place: after every waiting request of a lower value, before every later
  arrival of its own.

Arrival is a number the queue gives a request when it first joins (``Req.arrival``), not a
clock: two requests that join in one step keep the order they joined in. Kept sorted in a
list (insertion by bisection); the queue is read in order every step (admission takes its
head, ``lpm`` sorts it, the gauges count it), which a heap would not give.

``tokens`` counts the tokens its requests will prefill (prompt, and a retracted request's
output so far), kept as they join and leave: the load report reads it from another thread,
where summing over the list while the engine changes it would not be safe.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from services.scheduler.policy.req import Req


def priority_order(req: Req) -> tuple[int, int]:
    """The priority policy's key: (priority, arrival), lower first."""
    assert req.arrival is not None
    return req.priority, req.arrival


class WaitingQueue:
    """Requests waiting for admission, in the order the policy admits them (module docstring).

    Args:
        by_priority: order by (priority, arrival) (the ``priority`` policy); else arrival order.
    """

    def __init__(self, by_priority: bool = False):
        self.by_priority = by_priority
        self._reqs: list[Req] = []
        self._arrivals = itertools.count()
        self.tokens = 0  # sum of seq_len over the queue (a waiting request's does not change)

    def append(self, req: Req) -> None:
        """A request joins: it gets its arrival number and goes to its place."""
        if req.arrival is None:
            req.arrival = next(self._arrivals)
        self._insert(req, front=False)

    def extend(self, reqs: Iterable[Req]) -> None:
        for req in reqs:
            self.append(req)

    def requeue(self, req: Req) -> None:
        """A retracted request goes back: first in line, or under priority to its priority place."""
        self._insert(req, front=True)

    def _insert(self, req: Req, front: bool) -> None:
        self.tokens += req.seq_len
        if self.by_priority:
            bisect.insort(self._reqs, req, key=priority_order)
        elif front:
            self._reqs.insert(0, req)
        else:
            self._reqs.append(req)

    def popleft(self) -> Req:
        """Take the head. Raises IndexError when empty."""
        req = self._reqs.pop(0)
        self.tokens -= req.seq_len
        return req

    def remove(self, req: Req) -> None:
        """Drop a waiting request (an abort). Raises ValueError when it does not wait here."""
        self._reqs.remove(req)
        self.tokens -= req.seq_len

    def reorder(self, key: Callable[[Req], Any]) -> None:
        """Sort the queue by ``key`` (stable: equal keys keep their order), as ``lpm`` does each step."""
        self._reqs.sort(key=key)

    def clear(self) -> None:
        self._reqs.clear()
        self.tokens = 0

    def __getitem__(self, i: int) -> Req:
        return self._reqs[i]

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._reqs)

    def __contains__(self, req: object) -> bool:
        return req in self._reqs
