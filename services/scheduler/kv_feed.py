"""The asyncio side of the KV-cache events: subscribers of ``Scheduler.SubscribeKvEvents``
follow the engine's ``KvEventLog`` (policy/kv_events.py) from a sequence number on.

The engine thread only seals batches; ``wake`` (its ``on_batch``) hands a wake-up to the
event loop when someone is subscribed, so with no subscriber an event costs the engine
thread nothing beyond the append. Each subscriber reads the buffer from its own sequence,
so a slow one holds back no other and never the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ringserve.v1 import kv_events_pb2
from services.scheduler.engine.loop import EngineLoop
from services.scheduler.policy.kv_events import CacheCleared, KvEventBatch, KvEventLog, PagesRemoved


class KvEventFeed:
    """Streams ``loop.engine.kv_events`` to subscribers; created in the event loop's thread."""

    def __init__(self, loop: EngineLoop, scheduler_id: str):
        self.loop = loop
        self.log: KvEventLog = loop.engine.kv_events
        self.scheduler_id = scheduler_id
        self._aio = asyncio.get_running_loop()
        self._sealed = asyncio.Event()  # replaced on each wake: subscribers wait on the one they saw
        self.subscribers = 0
        self.log.on_batch = self.wake

    def wake(self) -> None:
        """Engine thread: a batch was sealed."""
        if self.subscribers:
            self._aio.call_soon_threadsafe(self._notify)

    def _notify(self) -> None:
        sealed, self._sealed = self._sealed, asyncio.Event()
        sealed.set()

    async def subscribe(
        self, request: kv_events_pb2.SubscribeKvEventsRequest
    ) -> AsyncIterator[kv_events_pb2.KvEventBatch]:
        """Batches from the request's start (a snapshot first when asked), then live, forever.

        Raises:
            EventsDropped: the start sequence is no longer (or not yet) in the buffer.
        """
        self.subscribers += 1
        try:
            if request.snapshot:
                start = await asyncio.wrap_future(self.loop.call(self.loop.engine.kv_snapshot))
            elif request.HasField("start_sequence"):
                start = request.start_sequence
            else:
                start = self.log.next_sequence
            while True:
                sealed = self._sealed
                batches = self.log.since(start)
                for batch in batches:
                    yield batch_to_proto(batch, self.scheduler_id)
                    start = batch.sequence + 1
                if not batches:
                    await sealed.wait()
        finally:
            self.subscribers -= 1


def batch_to_proto(batch: KvEventBatch, scheduler_id: str) -> kv_events_pb2.KvEventBatch:
    out = kv_events_pb2.KvEventBatch(sequence=batch.sequence, timestamp=batch.timestamp,
                                     scheduler_id=scheduler_id, snapshot=batch.snapshot)
    for event in batch.events:
        if isinstance(event, CacheCleared):
            out.events.add(cleared=kv_events_pb2.CacheCleared())
        elif isinstance(event, PagesRemoved):
            out.events.add(removed=kv_events_pb2.PagesRemoved(page_hashes=event.hashes))
        else:
            out.events.add(stored=kv_events_pb2.PagesStored(page_hashes=event.hashes, parent_hash=event.parent,
                                                           token_ids=event.token_ids, page_size=event.page_size))
    return out
