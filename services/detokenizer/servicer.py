"""gRPC adapter over DetokenizerManager: the scheduler's stream in, one stream per tokenizer out."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from ringserve import columns
from ringserve.metrics import ServiceMetrics, ignore_seconds
from ringserve.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc
from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.request_trace import RequestTracer

log = logging.getLogger(__name__)

# How often the scheduler's stream gets a LoadReport back (seconds).
LOAD_REPORT_INTERVAL_S = 1.0


def check_batch(batch: detokenizer_pb2.BatchTokenIDOutput, vocab_size: int) -> str | None:
    """Why ``batch`` breaks the columnar layout of detokenizer.proto, or None when it is sound.

    Checked before any state changes, so a malformed batch (a bug or a hostile peer) is
    refused whole instead of failing half-way through a step: the layout
    (``ringserve.columns.check``; the top-logprob widths are per rid, so only that the two
    top-logprob columns pair up), then ids against the vocabulary, prompt logprobs, embeddings and RowInits. A RowInit's
    prompt tail with ids outside the vocabulary is cleared in place (it is decode context only).
    """
    error = columns.check(batch, columns.TOKEN_IDS)
    if error is not None:
        return error
    n = len(batch.rids)
    for name in ("output_ids", "top_logprob_ids"):
        ids = getattr(batch, name)
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            return f"{name} hold ids outside the vocabulary [0, {vocab_size})"
    for p in batch.prompt_logprobs:
        if not (0 <= p.row < n and p.top_n >= 0 and len(p.top_ids) == len(p.top_vals) == p.top_n * len(p.logprobs)):
            return f"a PromptLogprobs (row {p.row} of {n}) is malformed"
    for e in batch.embeddings:
        if not 0 <= e.row < n:
            return f"a PooledEmbedding names row {e.row} of {n}"
    for init in batch.inits:
        if not 0 <= init.row < n:
            return f"a RowInit names row {init.row} of {n}"
        if init.top_logprobs_num < 0:
            return f"a RowInit has top_logprobs_num {init.top_logprobs_num}"
        tail = init.prompt_tail_ids
        if tail and (min(tail) < 0 or max(tail) >= vocab_size):
            # The scheduler's refusal of a request with bad input ids carries that input's
            # tail: only decode context, so it is dropped rather than the whole batch refused.
            del tail[:]
    return None


class AlreadySubscribed(Exception):
    """A Subscribe for a tokenizer id that already has a live subscription."""


class Subscriptions:
    """tokenizer id -> the output queue of its one live ``Subscribe`` stream.

    One id, one stream: a second Subscribe for an id that is subscribed is refused, never
    allowed to take the first one's outputs (a clashing id, or a caller posing as a
    tokenizer, would otherwise starve the real one). A stream that ends removes only its
    own entry, so a refused or replaced stream can never leave the owner unregistered. A
    tokenizer whose stale stream is still registered after a network blip retries until
    the server's keepalive ends that stream (``grpcutil.Transport.server_options``).
    """

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[detokenizer_pb2.BatchStrOutput]] = {}

    def add(self, tokenizer_id: str) -> asyncio.Queue[detokenizer_pb2.BatchStrOutput]:
        """Register a stream for ``tokenizer_id``; its queue. Raises AlreadySubscribed."""
        if tokenizer_id in self._queues:
            raise AlreadySubscribed(f"tokenizer {tokenizer_id!r} is already subscribed on another stream")
        queue: asyncio.Queue[detokenizer_pb2.BatchStrOutput] = asyncio.Queue()
        self._queues[tokenizer_id] = queue
        return queue

    def remove(self, tokenizer_id: str, queue: asyncio.Queue) -> bool:
        """Drop ``tokenizer_id``'s entry if it is still ``queue``'s stream; whether it was."""
        if self._queues.get(tokenizer_id) is not queue:
            return False
        del self._queues[tokenizer_id]
        return True

    def get(self, tokenizer_id: str) -> asyncio.Queue[detokenizer_pb2.BatchStrOutput] | None:
        return self._queues.get(tokenizer_id)

    def __contains__(self, tokenizer_id: object) -> bool:
        return tokenizer_id in self._queues

    def __len__(self) -> int:
        return len(self._queues)


class DetokenizerServicer(detokenizer_pb2_grpc.DetokenizerServicer):
    """``Detokenizer`` service: Stream (from the scheduler), Subscribe (per tokenizer), GetLoad.

    Each step's BatchStrOutput for a tokenizer goes to that tokenizer's Subscribe queue
    (one per id: ``Subscriptions``); rows for a tokenizer that has no subscription are dropped (their states are still
    deleted when they finish, so nothing leaks). When the last scheduler stream ends, every
    decode state is dropped: the scheduler that would finish them is gone (a scheduler that
    only lost its stream reconnects and aborts what it runs, resending each RowInit).
    """

    def __init__(self, manager: DetokenizerManager, instance_id: str) -> None:
        self.manager = manager
        self.instance_id = instance_id
        self.subscribers = Subscriptions()
        self.streams = 0  # open scheduler streams
        self.observe_step = ignore_seconds  # seconds route() took for one step (services/detokenizer/metrics.py)
        self.metrics: ServiceMetrics | None = None  # the service's registry and endpoint (main.start)
        self.requests: RequestTracer | None = None  # spans and log lines per request (main.start), when asked

    def load(self) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(instance_id=self.instance_id,
                                     decode_states=self.manager.num_decode_states)

    def route(self, batch: detokenizer_pb2.BatchTokenIDOutput) -> None:
        """Decode one step and hand each tokenizer its BatchStrOutput."""
        started = time.perf_counter()
        for tokenizer_id, out in self.manager.handle_batch(batch).items():
            queue = self.subscribers.get(tokenizer_id)
            if queue is not None:
                queue.put_nowait(out)
        self.observe_step(time.perf_counter() - started)
        if self.requests is not None:
            self.requests.observe(batch)

    async def Stream(self, request_iterator: AsyncIterator[detokenizer_pb2.BatchTokenIDOutput],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[detokenizer_pb2.DetokenizerEvent]:
        last = 0.0
        self.streams += 1
        try:
            await context.send_initial_metadata(())  # accepted: the scheduler counts itself connected
            async for batch in request_iterator:
                error = check_batch(batch, self.manager.vocab_size)
                if error is not None:
                    log.error("refusing a malformed BatchTokenIDOutput: %s", error)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed BatchTokenIDOutput: {error}")
                self.route(batch)
                now = time.monotonic()
                if now - last >= LOAD_REPORT_INTERVAL_S:
                    last = now
                    yield detokenizer_pb2.DetokenizerEvent(load=self.load())
        finally:
            self.streams -= 1
            if not self.streams:
                dropped = self.manager.drop_all()
                if self.requests is not None:
                    self.requests.drop_all("the scheduler stream ended")
                if dropped:
                    log.warning("scheduler stream ended; dropped %d decode states", dropped)

    async def Subscribe(self, request: detokenizer_pb2.SubscribeRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[detokenizer_pb2.BatchStrOutput]:
        if not request.tokenizer_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "tokenizer_id is required")
        try:
            queue = self.subscribers.add(request.tokenizer_id)
        except AlreadySubscribed as exc:
            log.warning("refused a second subscription for tokenizer %s", request.tokenizer_id)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        log.info("tokenizer %s subscribed", request.tokenizer_id)
        try:
            # Tells the subscriber its stream is registered: rows routed to it from now on arrive.
            await context.send_initial_metadata(())
            while True:
                yield await queue.get()
        finally:
            self.subscribers.remove(request.tokenizer_id, queue)
            log.info("tokenizer %s unsubscribed", request.tokenizer_id)

    async def GetLoad(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext) -> common_pb2.LoadReport:
        return self.load()
