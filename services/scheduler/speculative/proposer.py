"""The proposer interface: what a source of draft tokens implements."""

from __future__ import annotations

from typing import Protocol

from services.scheduler.policy.req import Req


class Proposer(Protocol):
    """Proposes draft tokens to continue requests' sequences (prompt + output so far).

    A proposer only reads the requests; it may keep state per request (a draft model's
    own KV cache), released through ``forget``.
    """

    def propose(self, reqs: list[Req], limits: list[int]) -> list[list[int]]:
        """Per request, at most ``limits[i]`` token ids likely to follow ``reqs[i].fill_ids()``
        (an empty list: no proposal for it this step)."""
        ...

    def forget(self, req: Req) -> None:
        """``req`` left the engine (finished, aborted): drop what is kept for it."""
        ...
