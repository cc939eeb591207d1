"""gRPC adapter over DetokenizerManager: the scheduler's stream in, one stream per tokenizer out."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from ringserve.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc
from services.detokenizer.manager import DetokenizerManager

log = logging.getLogger(__name__)

# How often the scheduler's stream gets a LoadReport back (seconds).
LOAD_REPORT_INTERVAL_S = 1.0


class DetokenizerServicer(detokenizer_pb2_grpc.DetokenizerServicer):
    """``Detokenizer`` service: Stream (from the scheduler), Subscribe (per tokenizer), GetLoad.

    Each step's BatchStrOutput for a tokenizer goes to that tokenizer's Subscribe queue;
    rows for a tokenizer that has no subscription are dropped (their states are still
    deleted when they finish, so nothing leaks).
    """

    def __init__(self, manager: DetokenizerManager, instance_id: str) -> None:
        self.manager = manager
        self.instance_id = instance_id
        self.subscribers: dict[str, asyncio.Queue[detokenizer_pb2.BatchStrOutput]] = {}

    def load(self) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(instance_id=self.instance_id,
                                     decode_states=self.manager.num_decode_states)

    def route(self, batch: detokenizer_pb2.BatchTokenIDOutput) -> None:
        """Decode one step and hand each tokenizer its BatchStrOutput."""
        for tokenizer_id, out in self.manager.handle_batch(batch).items():
            queue = self.subscribers.get(tokenizer_id)
            if queue is not None:
                queue.put_nowait(out)

    async def Stream(self, request_iterator: AsyncIterator[detokenizer_pb2.BatchTokenIDOutput],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[detokenizer_pb2.DetokenizerEvent]:
        last = 0.0
        async for batch in request_iterator:
            self.route(batch)
            now = time.monotonic()
            if now - last >= LOAD_REPORT_INTERVAL_S:
                last = now
                yield detokenizer_pb2.DetokenizerEvent(load=self.load())

    async def Subscribe(self, request: detokenizer_pb2.SubscribeRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[detokenizer_pb2.BatchStrOutput]:
        if not request.tokenizer_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tokenizer_id is required")
        queue: asyncio.Queue[detokenizer_pb2.BatchStrOutput] = asyncio.Queue()
        # A re-subscribing tokenizer (restart) takes over its id; the old stream ends.
        self.subscribers[request.tokenizer_id] = queue
        log.info("tokenizer %s subscribed", request.tokenizer_id)
        # Tells the subscriber its stream is registered: rows routed to it from now on arrive.
        await context.send_initial_metadata(())
        try:
            while True:
                yield await queue.get()
        finally:
            if self.subscribers.get(request.tokenizer_id) is queue:
                del self.subscribers[request.tokenizer_id]

    async def GetLoad(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext) -> common_pb2.LoadReport:
        return self.load()
