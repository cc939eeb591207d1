"""The public side of the KV-cache events and of the cache flush: the tokenizer relays each
replica's ``Scheduler.SubscribeKvEvents`` stream and fans ``FlushCache`` out to every replica.

A router reaches the schedulers through the API it already has (the tokenizer's address,
its API key); the schedulers' own ports stay internal. Each relayed batch is tagged with the
replica it comes from (``KvEventBatch.replica``: the scheduler address, as GetReadiness and
GetClusterLoad name replicas). The relay keeps no state: a router that reconnects asks again
from its last sequence + 1, and the scheduler's buffer answers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from ringserve.v1 import common_pb2, kv_events_pb2, scheduler_pb2_grpc
from services.tokenizer.errors import RequestError, invalid, unavailable
from services.tokenizer.replicas import Replica

FLUSH_TIMEOUT_S = 10.0


def _relayed(exc: grpc.aio.AioRpcError, replica: Replica) -> RequestError:
    """A scheduler's status, passed on with the replica named (UNAVAILABLE for a lost link)."""
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return unavailable(f"lost the scheduler at {replica.name}: {exc.details()}")
    return RequestError(f"scheduler {replica.name}: {exc.details()}", code, code.name.lower())


class KvEventRelay:
    def __init__(self, replicas: Sequence[Replica]):
        self.replicas = {r.name: r for r in replicas}

    def _replica(self, name: str) -> Replica:
        if not name and len(self.replicas) == 1:
            return next(iter(self.replicas.values()))
        if name not in self.replicas:
            known = ", ".join(self.replicas)
            what = "a replica is required" if not name else f"no replica {name!r}"
            raise invalid(f"{what}: this tokenizer's replicas are {known}", param="replica")
        return self.replicas[name]

    async def subscribe(
        self, request: kv_events_pb2.SubscribeKvEventsRequest
    ) -> AsyncIterator[kv_events_pb2.KvEventBatch]:
        """The replica's batches, each tagged with its name, until the scheduler's stream ends.

        Raises:
            RequestError: INVALID_ARGUMENT for an unknown or missing replica; UNAVAILABLE when
                its scheduler is not connected or the stream is lost; the scheduler's own
                status otherwise (OUT_OF_RANGE for a sequence outside its buffer).
        """
        replica = self._replica(request.replica)
        link = replica.scheduler
        if link.channel is None or not link.up:
            raise unavailable(f"the scheduler at {replica.name} is not connected")
        call = scheduler_pb2_grpc.SchedulerStub(link.channel).SubscribeKvEvents(request, metadata=link.metadata)
        try:
            async for batch in call:
                batch.replica = replica.name
                yield batch
        except grpc.aio.AioRpcError as exc:
            raise _relayed(exc, replica) from None
        finally:
            call.cancel()

    async def flush(self) -> None:
        """Flush every replica's prefix cache.

        Raises:
            RequestError: the first refusal (FAILED_PRECONDITION: requests in flight) or
                UNAVAILABLE, naming the replica; the others are flushed all the same.
        """
        async def one(replica: Replica) -> None:
            link = replica.scheduler
            if link.channel is None or not link.up:
                raise unavailable(f"the scheduler at {replica.name} is not connected")
            try:
                await scheduler_pb2_grpc.SchedulerStub(link.channel).FlushCache(
                    common_pb2.Empty(), timeout=FLUSH_TIMEOUT_S, metadata=link.metadata)
            except grpc.aio.AioRpcError as exc:
                raise _relayed(exc, replica) from None

        results = await asyncio.gather(*(one(r) for r in self.replicas.values()), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
