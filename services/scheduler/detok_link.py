"""The scheduler's client stream to the detokenizer (``Detokenizer.Stream``), with reconnects.

One BatchTokenIDOutput per engine step goes out in order. If the detokenizer goes away
the link reconnects with exponential backoff (tenacity); the message being written is kept
and sent first on the new stream, and messages produced meanwhile wait in the queue.
A lost stream means lost DecodeStatus (a restarted detokenizer has none; a live one drops
a stream's states when the stream ends), so the link calls ``on_lost`` as soon as a
connected stream ends: the service aborts what is in flight then, resending each RowInit,
and those rows reach the next detokenizer first. Requests that arrive while it is down
wait in the queue and are not touched. The stream presents ``metadata`` (the ring's
internal credential); a refused attempt is logged once per cause and retried.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import grpc
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from ringserve.grpcutil import RetryLog, stream_accepted
from ringserve.grpcutil import channel as grpc_channel
from ringserve.v1 import detokenizer_pb2, detokenizer_pb2_grpc

log = logging.getLogger(__name__)

ACCEPT_GRACE_S = 0.5  # a detokenizer that does not announce accepted streams: open this long is connected


class DetokenizerLink:
    """Owns the outgoing queue and the stream; ``run()`` until cancelled."""

    def __init__(self, target: str, on_lost: Callable[[], None] | None = None,
                 metadata: Sequence[tuple[str, str]] = ()):
        self.target = target
        self.on_lost = on_lost
        self.metadata = tuple(metadata)
        self._retry_log = RetryLog(log, f"detokenizer stream to {target}")
        self.queue: asyncio.Queue[detokenizer_pb2.BatchTokenIDOutput] = asyncio.Queue()
        self.connected = asyncio.Event()
        self.num_connects = 0
        self._pending: detokenizer_pb2.BatchTokenIDOutput | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def send_threadsafe(self, msg: detokenizer_pb2.BatchTokenIDOutput) -> None:
        """Queue a message from any thread (the engine thread); never blocks."""
        assert self._loop is not None, "run() must start before messages are sent"
        self._loop.call_soon_threadsafe(self.queue.put_nowait, msg)

    def bind_loop(self) -> None:
        """Record the running event loop; call from the loop before the engine thread starts."""
        self._loop = asyncio.get_running_loop()

    async def run(self) -> None:
        """Keep a stream open; reconnect with backoff (50 ms doubling to 2 s) on any gRPC failure."""
        self.bind_loop()
        retrying = AsyncRetrying(
            wait=wait_exponential(multiplier=0.05, max=2.0),
            retry=retry_if_exception_type(
                (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, ConnectionError)),
            before_sleep=self._retry_log,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                await self._session()

    async def _session(self) -> None:
        async with grpc_channel(self.target) as channel:
            call = detokenizer_pb2_grpc.DetokenizerStub(channel).Stream(metadata=self.metadata)
            # A refusal (a wrong credential) is retried, never counted as connected.
            await stream_accepted(call, ACCEPT_GRACE_S)
            self.num_connects += 1
            self._retry_log.reset()
            self.connected.set()
            log.info("detokenizer stream to %s connected", self.target)
            writer = asyncio.create_task(self._write(call))
            reader = asyncio.create_task(self._read(call))
            try:
                done, _ = await asyncio.wait({writer, reader}, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # raise the gRPC error, if any
                raise ConnectionError("detokenizer closed the stream")
            finally:
                self.connected.clear()
                if self.on_lost is not None:
                    self.on_lost()
                writer.cancel()
                reader.cancel()
                call.cancel()

    async def _write(self, call) -> None:
        while True:
            if self._pending is None:
                self._pending = await self.queue.get()
            await call.write(self._pending)
            self._pending = None

    async def _read(self, call) -> None:
        async for _event in call:
            pass  # DetokenizerEvents carry load reports, which the scheduler does not use yet
