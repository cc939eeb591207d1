"""The ``ringserve.v1.Tokenizer`` gRPC servicer: a thin adapter over ``TokenizerManager``.

Every ``RequestError`` becomes a gRPC status with its message as details and
"code"/"param" trailing metadata (see ``services.tokenizer.errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn

import grpc

from ringserve import tracing
from ringserve.limits import LimitExceeded, check_lora_fields
from ringserve.metrics import ignore_seconds
from ringserve.v1 import common_pb2, kv_events_pb2, lora_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer.embed import Embedder
from services.tokenizer.errors import RequestError, over_limit, unavailable
from services.tokenizer.kv_relay import KvEventRelay
from services.tokenizer.lora_relay import relay_lora
from services.tokenizer.manager import TokenizerManager
from services.tokenizer.request_trace import GenerateRecord, request_id

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name


async def _fail(context: grpc.aio.ServicerContext, err: RequestError) -> NoReturn:
    await context.abort(err.status, err.details(), trailing_metadata=err.trailing_metadata())
    raise AssertionError("context.abort returned")


# Occupancy summed from the schedulers' latest LoadReports into the tokenizer's own, so one
# GetLoad shows capacity: running and waiting requests, slots, KV.
_SCHEDULER_LOAD_FIELDS = (
    "num_running_reqs", "num_waiting_reqs", "req_slots_used", "kv_used_tokens", "kv_cached_tokens", "kv_total_tokens",
)


ReplicaLoads = Callable[[], Awaitable[Sequence[tuple[common_pb2.LoadReport | None, common_pb2.LoadReport | None]]]]


async def _no_replicas() -> list:
    return []


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Args:
        scheduler_loads: each replica's scheduler's latest streamed LoadReport (about 1 s
            old at most; None while its link is down).
        replica_loads: fresh (scheduler, detokenizer) LoadReports of every replica (None
            for a peer that did not answer), for GetClusterLoad.
        readiness: this instance's readiness with its reasons (``ReadinessMonitor.readiness``),
            for GetReadiness.
        kv_relay: the replicas' KV-cache event streams and cache flush (None: UNAVAILABLE).
        log_requests: log one line per Generate call (``--log-requests``).
    """

    def __init__(self, manager: TokenizerManager,
                 scheduler_loads: Callable[[], Sequence[common_pb2.LoadReport | None]] = lambda: [],
                 replica_loads: ReplicaLoads = _no_replicas,
                 readiness: Callable[[], tokenizer_pb2.Readiness] = lambda: tokenizer_pb2.Readiness(ready=True),
                 kv_relay: KvEventRelay | None = None, log_requests: bool = False):
        self.manager = manager
        self.kv_relay = kv_relay
        self.log_requests = log_requests  # --log-requests: a line per Generate call
        self.scheduler_loads = scheduler_loads
        self.replica_loads = replica_loads
        self.readiness = readiness
        self.observe_send = ignore_seconds  # per finished Generate call: seconds its writes to the client took
        self.embedder = Embedder(manager)

    # grpc.aio also serves a response stream written through context.write; the stub names only the iterator form.
    async def Generate(  # type: ignore[override]
            self, request: tokenizer_pb2.GenerateReqInput, context: grpc.aio.ServicerContext) -> None:
        """Stream GenerateOutputs; a cancelled call aborts the request (through ``aclose``).
        ``x-request-id`` metadata names the rid; the call's span and log line: ``GenerateRecord``."""
        metadata = context.invocation_metadata()
        record = None
        try:
            request_id(request, metadata)
        except RequestError as err:
            await _fail(context, err)
        if tracing.tracer is not None or self.log_requests:
            request.rid = request.rid or uuid.uuid4().hex  # the id the span and the log line name
            record = GenerateRecord(request, metadata, self.manager.facts.served_model_name, self.log_requests)
        outputs = self.manager.generate(request)
        sending = 0.0
        error, cancelled = None, False
        try:
            with record.current() if record is not None else contextlib.nullcontext():
                async for out in outputs:
                    if record is not None:
                        record.output(out)
                    started = time.perf_counter()
                    await context.write(out)
                    sending += time.perf_counter() - started
            self.observe_send(sending)
        except RequestError as err:
            error = err
            await _fail(context, err)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            await outputs.aclose()
            if record is not None:
                record.end(error, cancelled)

    async def Embed(self, request: tokenizer_pb2.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> tokenizer_pb2.EmbedResponse:
        """One vector per input (``services.tokenizer.embed``); a cancelled call aborts the inputs."""
        try:
            return await self.embedder.embed(request)
        except RequestError as err:
            await _fail(context, err)

    async def Abort(self, request: tokenizer_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> tokenizer_pb2.AbortResponse:
        return tokenizer_pb2.AbortResponse(found=self.manager.abort(request.rid))

    async def GetModelInfo(self, request: common_pb2.Empty,
                           context: grpc.aio.ServicerContext) -> tokenizer_pb2.ModelInfo:
        return self.manager.model_info()

    async def Tokenize(self, request: tokenizer_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> tokenizer_pb2.TokenizeResponse:
        try:
            return await self.manager.tokenize(request)
        except RequestError as err:
            await _fail(context, err)

    async def Detokenize(
        self, request: tokenizer_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.DetokenizeResponse:
        try:
            return await self.manager.detokenize(request)
        except RequestError as err:
            await _fail(context, err)

    async def TokenPieces(
        self, request: tokenizer_pb2.TokenIds, context: grpc.aio.ServicerContext
    ) -> tokenizer_pb2.TokenPiecesResponse:
        try:
            return await self.manager.token_pieces(request)
        except RequestError as err:
            await _fail(context, err)

    async def GetLoad(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext) -> common_pb2.LoadReport:
        """This instance's ReqState count plus its schedulers' last reported occupancy, summed."""
        report = self.manager.load()
        for upstream in self.scheduler_loads():
            if upstream is not None:
                for name in _SCHEDULER_LOAD_FIELDS:
                    setattr(report, name, getattr(report, name) + getattr(upstream, name))
        return report

    async def GetClusterLoad(self, request: common_pb2.Empty,
                             context: grpc.aio.ServicerContext) -> tokenizer_pb2.ClusterLoad:
        """This instance's own report and each replica's fresh scheduler and detokenizer reports."""
        out = tokenizer_pb2.ClusterLoad(tokenizer=self.manager.load())
        for sched, detok in await self.replica_loads():
            if sched is not None:
                out.schedulers.append(sched)
            if detok is not None:
                out.detokenizers.append(detok)
        return out

    async def GetReadiness(self, request: common_pb2.Empty,
                           context: grpc.aio.ServicerContext) -> tokenizer_pb2.Readiness:
        """Whether this instance can move a token, and why not (read from state: no I/O)."""
        return self.readiness()

    async def SubscribeKvEvents(self, request: kv_events_pb2.SubscribeKvEventsRequest,
                                context: grpc.aio.ServicerContext):
        """One replica's KV-cache events, relayed (docs/kv_events.md)."""
        try:
            if self.kv_relay is None:
                raise unavailable("this tokenizer relays no KV-cache events")
            async for batch in self.kv_relay.subscribe(request):
                yield batch
        except RequestError as err:
            await _fail(context, err)

    async def FlushCache(self, request: common_pb2.Empty, context: grpc.aio.ServicerContext) -> common_pb2.Empty:
        """Empty every replica's prefix cache; FAILED_PRECONDITION while one has requests in flight."""
        try:
            if self.kv_relay is None:
                raise unavailable("this tokenizer has no replica to flush")
            await self.kv_relay.flush()
        except RequestError as err:
            await _fail(context, err)
        return common_pb2.Empty()

    async def LoadLoraAdapter(self, request: lora_pb2.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> lora_pb2.LoraAdapterList:
        """Load a LoRA adapter on every replica (``lora_relay``)."""
        return await self._lora(context, "LoadLoraAdapter", request)

    async def UnloadLoraAdapter(self, request: lora_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> lora_pb2.LoraAdapterList:
        """Unload a LoRA adapter on every replica; requests running on it finish on it."""
        return await self._lora(context, "UnloadLoraAdapter", request)

    async def ListLoraAdapters(self, request: common_pb2.Empty,
                               context: grpc.aio.ServicerContext) -> lora_pb2.LoraAdapterList:
        """The LoRA adapters requests may name (the first replica's)."""
        return await self._lora(context, "ListLoraAdapters", request, everywhere=False)

    async def _lora(self, context: grpc.aio.ServicerContext, method: str, request: object,
                    everywhere: bool = True) -> lora_pb2.LoraAdapterList:
        try:
            try:
                check_lora_fields(getattr(request, "lora_name", ""), getattr(request, "lora_path", ""))
            except LimitExceeded as exc:
                raise over_limit(exc) from None
            if self.kv_relay is None:
                raise unavailable("this tokenizer has no scheduler")
            return await relay_lora(self.kv_relay.replicas.values(), method, request, everywhere)
        except RequestError as err:
            await _fail(context, err)
