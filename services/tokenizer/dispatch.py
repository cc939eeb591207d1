"""How the tokenizer reaches its schedulers: the ``Dispatcher`` (one scheduler stream) and the
``Balancer`` that picks one among several replicas. ``TokenizerManager`` depends on these
protocols only; ``services.tokenizer.links`` and ``services.tokenizer.replicas`` implement them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from ringserve.v1 import scheduler_pb2


class Dispatcher(Protocol):
    """The tokenizer's side of the scheduler stream. Both methods are synchronous (queue puts).

    Raises:
        RequestError: UNAVAILABLE when the scheduler stream is down.
    """

    def send_req(self, req: scheduler_pb2.TokenizedGenerateReqInput) -> None: ...

    def send_abort(self, abort: scheduler_pb2.AbortReq) -> None: ...

    @property
    def schedule_policy(self) -> str | None:
        """The scheduler's --schedule-policy as it last reported it; None while unknown."""
        ...


class Balancer(Protocol):
    """Picks the replica (a Dispatcher) for a request among several (see ``services.tokenizer.replicas``)."""

    def pick(self, input_ids: Sequence[int], outstanding: Mapping[Dispatcher, int]) -> Dispatcher:
        """The replica for a prompt, given this instance's in-flight requests per replica.

        Raises:
            RequestError: UNAVAILABLE when no replica has both links up.
        """
        ...
