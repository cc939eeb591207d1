"""The model replicas a tokenizer instance talks to: each a scheduler with its detokenizer.

A ``Replica`` pairs one ``SchedulerLink`` (it is the manager's ``Dispatcher`` for the
requests sent there) with one ``DetokenizerLink``; it can take requests only while both
are up. ``ReplicaSet`` is the manager's ``Balancer``: it asks the ``Router`` (least
outstanding work, then prefix affinity) among the replicas that are up, those that can
move a token first (``services.tokenizer.readiness``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from ringserve.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.tokenizer import disagg_pair
from services.tokenizer.errors import unavailable
from services.tokenizer.links import DetokenizerLink, Link, SchedulerLink
from services.tokenizer.router import Router

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class ReplicaAddress:
    """Where one replica listens: its scheduler's and its detokenizer's gRPC addresses."""

    scheduler: str
    detokenizer: str

    @classmethod
    def parse(cls, spec: str) -> ReplicaAddress:
        """``"SCHED_ADDR,DETOK_ADDR"`` -> ReplicaAddress. Raises ValueError on another shape."""
        parts = [p.strip() for p in spec.split(",")]
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"a replica is 'SCHEDULER_ADDR,DETOKENIZER_ADDR', not {spec!r}")
        return cls(parts[0], parts[1])


class Replica:
    """One scheduler + detokenizer pair, named by its scheduler address (stable across instances).

    ``send_req``/``send_abort`` go to its scheduler stream (RequestError UNAVAILABLE when down).
    Every call to either peer presents ``metadata`` (the ring's internal credential).
    """

    def __init__(
        self,
        address: ReplicaAddress,
        instance_id: str,
        on_batch: Callable[[detokenizer_pb2.BatchStrOutput], None],
        on_change: Callable[[Link, bool], None],
        metadata: Sequence[tuple[str, str]] = (),
    ):
        self.address = address
        self.name = address.scheduler
        self.scheduler = SchedulerLink(address.scheduler, instance_id, on_change, metadata)
        self.detokenizer = DetokenizerLink(address.detokenizer, instance_id, on_batch, on_change, metadata)

    @property
    def up(self) -> bool:
        return self.scheduler.up and self.detokenizer.up

    @property
    def schedule_policy(self) -> str | None:
        return self.scheduler.schedule_policy

    def send_req(self, req: scheduler_pb2.TokenizedGenerateReqInput) -> None:
        self.scheduler.send_req(req)

    def send_abort(self, abort: scheduler_pb2.AbortReq) -> None:
        self.scheduler.send_abort(abort)

    def start(self) -> None:
        self.scheduler.start()
        self.detokenizer.start()

    async def loads(self) -> tuple[common_pb2.LoadReport | None, common_pb2.LoadReport | None]:
        """Fresh (scheduler, detokenizer) LoadReports from GetLoad; None for a peer that does not answer."""
        sched, detok = await asyncio.gather(
            _get_load(self.scheduler, scheduler_pb2_grpc.SchedulerStub),
            _get_load(self.detokenizer, detokenizer_pb2_grpc.DetokenizerStub),
        )
        return sched, detok


async def _get_load(link: Link, stub_cls: Callable) -> common_pb2.LoadReport | None:
    channel = link.channel
    if channel is None or not link.up:
        return None
    try:
        return await stub_cls(channel).GetLoad(common_pb2.Empty(), timeout=LOAD_TIMEOUT_S, metadata=link.metadata)
    except grpc.aio.AioRpcError as exc:
        logger.warning("GetLoad on the %s at %s failed: %s", link.name, link.target, exc.code().name)
        return None


class ReplicaSet:
    """The manager's Balancer over several replicas (see ``services.tokenizer.router``)."""

    def __init__(self, replicas: Sequence[Replica], router: Router | None = None):
        if not replicas:
            raise ValueError("at least one replica is needed")
        names = [r.name for r in replicas]
        if len(set(names)) != len(names):
            raise ValueError(f"a scheduler address is given twice: {names}")
        self.replicas = tuple(replicas)
        self.router = router or Router()
        self.pairs = disagg_pair.Pairs()
        # Whether a replica can move a token (services.tokenizer.readiness); set by the service.
        self.can_move_tokens: Callable[[Replica], bool] = lambda replica: True

    def pick(self, input_ids: Sequence[int], outstanding: Mapping[Any, int]) -> Replica:
        """The replica for a prompt among those with both links up, preferring those that
        can move a token (a stalled one gets requests only when no other is up); the
        choice is recorded.

        Raises:
            RequestError: UNAVAILABLE when no replica is up.
        """
        up = [r for r in self.replicas if r.up]
        if not up:
            raise unavailable(_none_up(self.replicas))
        eligible = {r.name: r for r in up if self.can_move_tokens(r)} or {r.name: r for r in up}
        if any(disagg_pair.role(r) != "null" for r in eligible.values()):  # prefill/decode schedulers: a pair
            pair = self.pairs.choose(self.router, input_ids, list(eligible.values()), outstanding)
            if pair is None:
                raise disagg_pair.no_pair(list(eligible.values()))
            return pair  # type: ignore[return-value]  # a Dispatcher, like a Replica
        name = self.router.choose(input_ids, {n: outstanding.get(r, 0) for n, r in eligible.items()})
        self.router.record(input_ids, name)
        return eligible[name]

    def of(self, link: Link) -> Replica:
        """The replica that owns ``link``."""
        return next(r for r in self.replicas if link in (r.scheduler, r.detokenizer))


def _none_up(replicas: Sequence[Replica]) -> str:
    if len(replicas) == 1:
        r = replicas[0]
        if not r.scheduler.up:
            return "the scheduler is not connected"
        return "the detokenizer subscription is down"
    return f"no model replica is connected (0 of {len(replicas)} have their scheduler and detokenizer up)"
