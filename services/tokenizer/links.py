"""The tokenizer's two long-lived connections in the ring, each reconnecting with backoff.

- ``SchedulerLink``: one bidirectional ``Scheduler.Connect`` stream. The first
  message is the hello (an AbortReq with an empty rid naming this instance's
  tokenizer_id); TokenizedGenerateReqInput and AbortReq follow, in order, from a
  queue filled synchronously by the manager (it is a ``services.tokenizer.dispatch.Dispatcher``).
- ``DetokenizerLink``: one ``Detokenizer.Subscribe(tokenizer_id)`` stream whose
  BatchStrOutput messages go to the manager's ``handle_batch``.

Either stream counts as up when the peer sends the call's initial metadata (ringserve's
do once the stream is registered: the scheduler with its first LoadReport), or, if it
does not, after ``ACCEPT_GRACE_S`` with the call still open. A peer that refuses the stream
(UNAUTHENTICATED: a wrong internal credential; ALREADY_EXISTS: this instance's own stale
stream is still registered after a network blip) ends it there instead; the link logs
why, once per cause, and retries. Every call presents ``metadata``: the ring's internal
credential (``ringserve.internal_auth``).

When a session ends (peer gone, stream closed) the link reports down at once, so
the manager fails every in-flight request with UNAVAILABLE, then reconnects with
exponential backoff and jitter (tenacity), forever, until ``stop()``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import grpc
from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential, wait_random

from ringserve.grpcutil import RetryLog, describe_error, stream_accepted
from ringserve.grpcutil import channel as grpc_channel
from ringserve.metrics import ignore_seconds
from ringserve.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.tokenizer.errors import unavailable

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
ACCEPT_GRACE_S = 0.5
BACKOFF_INITIAL_S = 0.05
BACKOFF_MAX_S = 2.0

_RETRYABLE = (grpc.aio.AioRpcError, asyncio.TimeoutError, ConnectionError, grpc.aio.UsageError)


class Link(ABC):
    """A connection to one peer that is either up or reconnecting.

    Args:
        name: "scheduler" or "detokenizer", for messages.
        target: the peer's address ("host:port" or "unix:path").
        on_change: called with (link, up) on every transition; on a loss it runs
            before anything else touches the link, so in-flight requests fail first.
        metadata: sent with every call on the link (the internal credential).
    """

    def __init__(self, name: str, target: str, on_change: Callable[[Link, bool], None],
                 metadata: Sequence[tuple[str, str]] = ()):
        self.name = name
        self.target = target
        self.on_change = on_change
        self.metadata = tuple(metadata)
        self._retry_log = RetryLog(logger, f"{name} stream at {target}")
        self.up = False
        self.sessions = 0  # successful connections so far
        self.channel: grpc.aio.Channel | None = None  # the session's channel while up (unary calls)
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"{self.name}-link")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while not self._stopping:
            channel = None
            failed = False
            try:
                async for attempt in AsyncRetrying(
                    wait=wait_exponential(multiplier=BACKOFF_INITIAL_S, max=BACKOFF_MAX_S)
                    + wait_random(0, BACKOFF_INITIAL_S),
                    retry=retry_if_exception_type(_RETRYABLE),
                    before_sleep=self._retry_log,
                ):
                    with attempt:
                        if channel is not None:
                            await channel.close()
                        channel = grpc_channel(self.target)
                        await asyncio.wait_for(channel.channel_ready(), CONNECT_TIMEOUT_S)
                        call = await self._open(channel)
                self.sessions += 1
                self._retry_log.reset()
                self.channel = channel
                self._set(True)
                await self._pump(call)
                logger.warning("%s stream at %s closed", self.name, self.target)
            except _RETRYABLE as exc:
                logger.warning("%s stream at %s lost (%s)", self.name, self.target, describe_error(exc))
            except Exception:
                logger.exception("%s stream at %s failed", self.name, self.target)
                failed = True
            finally:
                self.channel = None
                self._set(False)
                if channel is not None:
                    await channel.close()
            if failed:  # a bug, not a lost peer: do not spin
                await asyncio.sleep(BACKOFF_MAX_S)

    def _set(self, up: bool) -> None:
        if up != self.up:
            self.up = up
            self.on_change(self, up)

    @abstractmethod
    async def _open(self, channel: grpc.aio.Channel) -> grpc.aio.Call:
        """Start the stream on a ready channel; raise a retryable error if the peer refuses."""

    @abstractmethod
    async def _pump(self, call: grpc.aio.Call) -> None:
        """Run the stream until it ends (return) or fails (raise)."""


class SchedulerLink(Link):
    """The scheduler stream; also a ``Dispatcher`` (services/tokenizer/dispatch.py: ``send_req``, ``send_abort``)."""

    def __init__(self, target: str, instance_id: str, on_change: Callable[[Link, bool], None],
                 metadata: Sequence[tuple[str, str]] = ()):
        super().__init__("scheduler", target, on_change, metadata)
        self.instance_id = instance_id
        # Each message with the perf_counter() time it was queued at.
        self._queue: asyncio.Queue[tuple[scheduler_pb2.SchedulerInput, float]] = asyncio.Queue()
        self.observe_dispatch = ignore_seconds  # seconds from queueing a request to its write on the stream
        # The scheduler's latest LoadReport event (sent about once a second); None while down.
        self.last_load: common_pb2.LoadReport | None = None

    @property
    def schedule_policy(self) -> str | None:
        """The scheduler's --schedule-policy from its latest LoadReport (sent as the stream
        opens); None while none has arrived."""
        load = self.last_load
        return (load.schedule_policy or None) if load is not None else None

    def _put(self, msg: scheduler_pb2.SchedulerInput) -> None:
        if not self.up:
            raise unavailable(f"the scheduler at {self.target} is not connected")
        self._queue.put_nowait((msg, time.perf_counter()))

    def send_req(self, req: scheduler_pb2.TokenizedGenerateReqInput) -> None:
        """Queue a request. Raises RequestError (UNAVAILABLE) when the stream is down."""
        self._put(scheduler_pb2.SchedulerInput(req=req))

    def send_abort(self, abort: scheduler_pb2.AbortReq) -> None:
        """Queue an abort. Raises RequestError (UNAVAILABLE) when the stream is down."""
        self._put(scheduler_pb2.SchedulerInput(abort=abort))

    async def flush(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for queued messages (aborts at shutdown) to be written."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.up and not self._queue.empty() and loop.time() < deadline:
            await asyncio.sleep(0.01)

    async def _open(self, channel: grpc.aio.Channel) -> grpc.aio.Call:
        call = scheduler_pb2_grpc.SchedulerStub(channel).Connect(metadata=self.metadata)
        hello = scheduler_pb2.AbortReq(rid="", abort_all=False, tokenizer_id=self.instance_id)
        await call.write(scheduler_pb2.SchedulerInput(abort=hello))
        await stream_accepted(call, ACCEPT_GRACE_S)
        # Messages queued for an earlier session belong to requests that were failed.
        self._queue = asyncio.Queue()
        return call

    async def _pump(self, call: grpc.aio.Call) -> None:
        async def write() -> None:
            while True:
                msg, queued = await self._queue.get()
                await call.write(msg)
                if msg.HasField("req"):
                    self.observe_dispatch(time.perf_counter() - queued)

        async def read() -> None:
            while (event := await call.read()) is not grpc.aio.EOF:
                if event.HasField("load"):
                    self.last_load = event.load

        tasks = [asyncio.create_task(write()), asyncio.create_task(read())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            self.last_load = None
            # No await here: the loss must reach the manager before anything else runs.
            for task in tasks:
                task.cancel()
            call.cancel()


class DetokenizerLink(Link):
    """The detokenizer subscription; every BatchStrOutput goes to ``on_batch``."""

    def __init__(
        self,
        target: str,
        instance_id: str,
        on_batch: Callable[[detokenizer_pb2.BatchStrOutput], None],
        on_change: Callable[[Link, bool], None],
        metadata: Sequence[tuple[str, str]] = (),
    ):
        super().__init__("detokenizer", target, on_change, metadata)
        self.instance_id = instance_id
        self.on_batch = on_batch
        self.last_batch_at = 0.0  # time.monotonic() of the latest BatchStrOutput (readiness's stall check)

    async def _open(self, channel: grpc.aio.Channel) -> grpc.aio.Call:
        call = detokenizer_pb2_grpc.DetokenizerStub(channel).Subscribe(
            detokenizer_pb2.SubscribeRequest(tokenizer_id=self.instance_id), metadata=self.metadata
        )
        await stream_accepted(call, ACCEPT_GRACE_S)
        return call

    async def _pump(self, call: grpc.aio.Call) -> None:
        try:
            async for batch in call:
                self.last_batch_at = time.monotonic()
                self.on_batch(batch)
        finally:
            call.cancel()
