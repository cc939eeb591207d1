"""gRPC adapter over the engine loop: ``Scheduler.Connect``, ``GetLoad``, ``SubscribeKvEvents``, ``FlushCache``
and the LoRA RPCs (``lora.admin``)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from ringserve.v1 import common_pb2, kv_events_pb2, lora_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.engine.loop import EngineLoop
from services.scheduler.kv_feed import KvEventFeed
from services.scheduler.lora.admin import LoraRefused, adapter_list, load_adapter, unload_adapter
from services.scheduler.policy.kv_events import EventsDropped
from services.scheduler.wire import load_to_proto, req_input_from_proto

log = logging.getLogger(__name__)

class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """One Connect stream per tokenizer instance; rids it owns die with its stream.

    A tokenizer id has at most one live stream: a second hello naming an id that is
    connected is refused (ALREADY_EXISTS), so it can neither take that tokenizer's
    requests nor, when it ends, abort them. A stream's aborts reach only its own
    tokenizer's requests.
    """

    def __init__(self, loop: EngineLoop, instance_id: str, load_report_interval_s: float = 1.0, tp_size: int = 1,
                 model_names: frozenset[str] = frozenset(), disaggregation_mode: str = "null"):
        self.loop = loop
        self.model_names = model_names  # the base model's served name and path: no adapter may take them
        self.disaggregation_mode = disaggregation_mode
        self.instance_id = instance_id
        self.tp_size = tp_size
        self.load_report_interval_s = load_report_interval_s
        self.connected: set[str] = set()  # tokenizer ids with a live Connect stream
        self._kv_feed: KvEventFeed | None = None  # made by the first subscriber, in the event loop

    def _load_event(self) -> scheduler_pb2.SchedulerEvent:
        return scheduler_pb2.SchedulerEvent(load=self._load())

    async def Connect(self, request_iterator, context: grpc.aio.ServicerContext):
        """Bidi stream: hello (AbortReq, empty rid, tokenizer_id), then requests and aborts.

        Sends a LoadReport event at once and then every ``load_report_interval_s``. When
        the stream ends for any reason, every rid the tokenizer owns is aborted.

        Errors: INVALID_ARGUMENT when the first message is not a hello; ALREADY_EXISTS when
        its tokenizer_id has a live stream (a tokenizer whose own stale stream is still
        open retries until the server's keepalive ends it).
        """
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("msg") != "abort" or first.abort.rid or not first.abort.tokenizer_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the first Connect message must be an AbortReq hello with an empty rid and a tokenizer_id",
            )
            return  # not reached: abort raises
        tokenizer_id = first.abort.tokenizer_id
        if tokenizer_id in self.connected:
            log.warning("refused a second Connect stream for tokenizer %s", tokenizer_id)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"tokenizer {tokenizer_id!r} is already connected on another stream")
        self.connected.add(tokenizer_id)
        log.info("tokenizer %s connected", tokenizer_id)
        reader = asyncio.create_task(self._read(request_iterator, tokenizer_id))
        try:
            yield self._load_event()
            while not reader.done():
                await asyncio.wait({reader}, timeout=self.load_report_interval_s)
                if not reader.done():
                    yield self._load_event()
            reader.result()
        finally:
            reader.cancel()
            self.connected.discard(tokenizer_id)
            log.info("tokenizer %s stream closed; aborting its requests", tokenizer_id)
            self.loop.abort(tokenizer_id=tokenizer_id, message=f"tokenizer {tokenizer_id} stream closed",
                            status="UNAVAILABLE")

    async def _read(self, request_iterator, tokenizer_id: str) -> None:
        async for msg in request_iterator:
            kind = msg.WhichOneof("msg")
            if kind == "req":
                # The engine validates it (NaN and every bound included: policy/validate.py).
                self.loop.submit(req_input_from_proto(msg.req, tokenizer_id))
            elif kind == "abort":
                # Only this stream's own requests: an AbortReq naming another tokenizer (or
                # another tokenizer's rid) aborts nothing.
                a = msg.abort
                reason = a.reason or "aborted by the tokenizer"
                if a.tokenizer_id and a.tokenizer_id != tokenizer_id:
                    log.warning("tokenizer %s sent an AbortReq for tokenizer %s; ignored", tokenizer_id, a.tokenizer_id)
                elif a.abort_all:
                    self.loop.abort(tokenizer_id=tokenizer_id, message=reason)
                elif a.rid:
                    self.loop.abort(rid=a.rid, tokenizer_id=tokenizer_id, message=reason)

    async def GetLoad(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext) -> common_pb2.LoadReport:
        return self._load()

    def _load(self) -> common_pb2.LoadReport:
        return load_to_proto(self.loop.load(), self.instance_id, self.tp_size, self.disaggregation_mode)

    async def SubscribeKvEvents(self, request: kv_events_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext):
        """The prefix cache's page events (docs/kv_events.md). OUT_OF_RANGE when the start
        sequence is no longer (or not yet) in the buffer; the message names what it holds."""
        if self._kv_feed is None:
            self._kv_feed = KvEventFeed(self.loop, self.instance_id)
        try:
            async for batch in self._kv_feed.subscribe(request):
                yield batch
        except EventsDropped as exc:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))

    async def FlushCache(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        """Empty the prefix cache; FAILED_PRECONDITION while requests are in flight."""
        if not await asyncio.wrap_future(self.loop.call(self.loop.engine.flush_cache)):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "the cache was not flushed: requests are in flight; retry when the scheduler is idle")
        return common_pb2.Empty()

    async def LoadLoraAdapter(self, request: lora_pb2.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> lora_pb2.LoraAdapterList:
        """Load a PEFT adapter (``lora.admin.load_adapter``); the list after it."""
        engine = self.loop.engine
        return await self._lora(context, lambda: load_adapter(engine.lora, request, self.model_names.__contains__))

    async def UnloadLoraAdapter(self, request: lora_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> lora_pb2.LoraAdapterList:
        """Unload an adapter (``lora.admin.unload_adapter``); the list after it."""
        engine = self.loop.engine
        return await self._lora(context, lambda: unload_adapter(engine.lora, request))

    async def ListLoraAdapters(self, request: common_pb2.Empty,
                               context: grpc.aio.ServicerContext) -> lora_pb2.LoraAdapterList:
        engine = self.loop.engine
        return await self._lora(context, lambda: adapter_list(engine.lora))

    async def _lora(self, context: grpc.aio.ServicerContext, op) -> lora_pb2.LoraAdapterList:
        """Run a LoRA operation in the engine thread; a refusal aborts the RPC with its status."""
        try:
            return await asyncio.wrap_future(self.loop.call(op))
        except LoraRefused as exc:
            log.warning("LoRA request refused: %s", exc.message)
            await context.abort(getattr(grpc.StatusCode, exc.status), exc.message)
            raise  # not reached: abort raises
