"""The gRPC side of disaggregation: the decode scheduler's ``Disagg`` servicer and the prefill
scheduler's sender (``KvSender``), both in the scheduler's event loop.

The sender's order for each handoff, opened when the engine admits the request: ``Reserve``
(waits for the decode side's slot and rows: backpressure) while the first chunk computes, the
transfer engine's ``send`` of each chunk's rows into those rows as the engine hands them on
(while the next chunk computes), the last chunk's rows, ``Commit`` with the first token; then
the engine releases the rows into its prefix cache. Any failure -- the decode scheduler
unreachable or gone, the rid aborted there, the deadline (``--disaggregation-transfer-timeout``
for each wait: the reservation, a range, the commit) passed -- ends the request on the prefill
side with a FINISH_ABORT row that says which, and the tokenizer then aborts it on the decode
side too. An abort here stops the sender between ranges.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence

import grpc

from ringserve import grpcutil
from ringserve.metrics import Read, ServiceMetrics
from ringserve.v1 import common_pb2, disagg_pb2, disagg_pb2_grpc
from services.scheduler.disagg.engines import make_transfer
from services.scheduler.disagg.handoff import Handoff, ShortCommit
from services.scheduler.disagg.transfer import GrpcKvTransfer, KvLayout, KvTransfer, Range, TransferError
from services.scheduler.engine.loop import EngineLoop

log = logging.getLogger(__name__)

ARRIVAL_GRACE_S = 2.0  # Reserve waits this long for a rid the tokenizer has not delivered yet


class DisaggServicer(disagg_pb2_grpc.DisaggServicer):
    """Decode side: ``Reserve``, ``PushKv``, ``Commit`` (protos/ringserve/v1/disagg.proto)."""

    def __init__(self, loop: EngineLoop, transfer: KvTransfer):
        self.loop = loop
        self.state = loop.engine.disagg
        self.transfer = transfer
        self.layout = KvLayout.of(loop.engine.kv_pool)
        self._reserved = asyncio.Condition()
        aio = asyncio.get_running_loop()
        self.state.on_reserved = lambda rid: aio.call_soon_threadsafe(lambda: aio.create_task(self._notify()))

    async def _notify(self) -> None:
        async with self._reserved:
            self._reserved.notify_all()

    async def Reserve(self, request, context):
        mismatch = self.layout.mismatch(KvLayout.from_proto(request.layout))
        if mismatch:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, mismatch)
        started = time.monotonic()
        while (rows := self.state.lend(request.rid)) is None:
            if request.rid not in self.loop.engine.reqs and time.monotonic() - started > ARRIVAL_GRACE_S:
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"request {request.rid!r} is not held by this decode scheduler (aborted?)")
            async with self._reserved:
                try:
                    await asyncio.wait_for(self._reserved.wait(), 0.1)
                except asyncio.TimeoutError:
                    pass
        if rows.numel() != request.num_tokens:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{rows.numel()} rows are reserved for {request.rid!r}, not {request.num_tokens}")
        return disagg_pb2.KvReservation(rid=request.rid, kv_rows=rows.tolist(), transfer_engine=self.transfer.name,
                                        engine_bootstrap=self.transfer.bootstrap())

    async def PushKv(self, request_iterator, context):
        total = 0
        leases: list[str] = []

        try:
            async for chunk in request_iterator:
                try:
                    if chunk.k or chunk.v:  # an abort waits for the write: it never frees rows a piece lands in
                        n = await asyncio.to_thread(self.state.receive, self.transfer, chunk)
                    elif chunk.written:  # a one-sided engine's report of a range it wrote
                        n = 0 if self.state.wrote(chunk.rid, chunk.start, chunk.written) else -1
                    else:  # a one-sided engine's lease: open while it writes
                        leases.append(chunk.rid)
                        continue
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                if n < 0:
                    await context.abort(grpc.StatusCode.NOT_FOUND, f"request {chunk.rid!r} holds no reservation here")
                total += n
        finally:  # ended, failed, or the sender gone (cancelled): it writes no more
            for rid in leases:
                self.loop.call(functools.partial(self.state.writer_done, rid))
        return disagg_pb2.KvPushAck(bytes=total)

    async def Commit(self, request, context):
        try:
            committed = await asyncio.wrap_future(self.loop.call(lambda: self.state.commit(request)))
        except ShortCommit as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        if not committed:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request {request.rid!r} holds no reservation here")
        return common_pb2.Empty()


class Aborted(Exception):
    """The request of a handoff was aborted on this side: its sender stops between ranges."""


class Session:
    """One request's handoff on the sender's side: the ranges of rows the engine hands on, in
    order, then the commit (``Handoff``); ``aborted`` ends it between ranges.

    Iterating it yields the ranges as they come; it ends after the last (when the handoff's
    commit is here) and raises ``Aborted`` after an abort. ``busy_s`` counts the seconds from
    each range's arrival to the engine's request for the next: the transfer's own time, not the
    wait for the prefill side's next chunk."""

    def __init__(self, rid: str, bootstrap: str, num_tokens: int):
        self.rid, self.bootstrap, self.num_tokens = rid, bootstrap, num_tokens
        self.queue: asyncio.Queue[Range | Handoff | None] = asyncio.Queue()
        self.handoff: Handoff | None = None
        self.busy_s = 0.0
        self.deadline = float("inf")  # time.monotonic(): moved on as ranges come
        self.ended = False
        self.aborted = False

    async def __aiter__(self) -> AsyncIterator[Range]:
        while True:
            item = await self.queue.get()
            arrived = time.monotonic()
            if item is None:
                raise Aborted(self.rid)
            if isinstance(item, Handoff):
                self.handoff = item
                if item.start < item.src_rows.numel():
                    yield item.start, item.src_rows[item.start :]
                    self.busy_s += time.monotonic() - arrived
                return
            yield item
            self.busy_s += time.monotonic() - arrived

    def put(self, item: Range | Handoff | None, timeout_s: float) -> None:
        """Hand on a range, the commit (``Handoff``) or an abort (None); the deadline restarts:
        ``timeout_s`` for the next piece of work (the first chunk's compute does not count
        against the last's transfer)."""
        self.queue.put_nowait(item)
        self.aborted = self.aborted or item is None
        if item is not None:
            self.deadline = time.monotonic() + timeout_s

    async def watch(self, work: Awaitable[None]) -> None:
        """Run ``work`` until it ends or the deadline passes (then cancelled; raises TimeoutError).
        The deadline moves while it runs, so ``asyncio.wait_for`` does not serve."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=max(0.0, self.deadline - time.monotonic()))
                if not task.done() and time.monotonic() >= self.deadline:
                    task.cancel()
                    await asyncio.wait({task})
                    raise TimeoutError(self.rid)
        except asyncio.CancelledError:
            task.cancel()
            raise
        task.result()


class KvSender:
    """Prefill side: moves each handoff the engine opens (see the module docstring).

    Args:
        loop: the engine loop (its engine's ``disagg`` seams are set here).
        transfer: the transfer engine.
        metadata: the ring's internal credential, presented to the decode scheduler.
        timeout_s: deadline of each wait of a handoff: the reservation, a range's transfer,
            the commit (the time between chunks, the prefill side's own, does not count).
    """

    def __init__(self, loop: EngineLoop, transfer: KvTransfer, metadata: Sequence[tuple[str, str]], timeout_s: float):
        self.loop = loop
        self.transfer = transfer
        self.metadata = tuple(metadata)
        self.timeout_s = timeout_s
        self.layout = KvLayout.of(loop.engine.kv_pool).to_proto()
        # A decode scheduler may name another engine in its reservation (one without a role
        # streams through gRPC): this side follows it.
        self._engines = {e.name: e for e in (GrpcKvTransfer(transfer.to_device), transfer)}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tasks: set[asyncio.Task] = set()
        self.sessions: dict[str, Session] = {}
        self.bytes_sent = 0
        self.seconds = 0.0
        aio = asyncio.get_running_loop()
        state = loop.engine.disagg
        state.on_open = lambda rid, bootstrap, n: aio.call_soon_threadsafe(self.open, rid, bootstrap, n)
        state.on_range = lambda rid, first, rows: aio.call_soon_threadsafe(self._put, rid, (first, rows))
        state.on_handoff = lambda handoff: aio.call_soon_threadsafe(self._put, handoff.rid, handoff)
        state.on_cancel = lambda rid: aio.call_soon_threadsafe(self._put, rid, None)

    def open(self, rid: str, bootstrap: str, num_tokens: int) -> Session:
        """Start the handoff of ``rid``: ``Reserve`` now, the ranges as they come."""
        session = self.sessions[rid] = Session(rid, bootstrap, num_tokens)
        session.deadline = time.monotonic() + self.timeout_s
        task = asyncio.create_task(self._send(session))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return session

    def _put(self, rid: str, item: Range | Handoff | None) -> None:
        session = self.sessions.get(rid)
        if session is None:
            if not isinstance(item, Handoff):
                return  # an abort after the end
            session = self.open(rid, item.bootstrap, int(item.src_rows.numel()))  # not opened early
        elif session.ended:  # it failed before it took the handoff: the engine's last word on it
            del self.sessions[rid]
            return
        session.put(item, self.timeout_s)

    def _channel(self, target: str) -> grpc.aio.Channel:
        if target not in self._channels:
            self._channels[target] = grpcutil.channel(target)
        return self._channels[target]

    async def _send(self, s: Session) -> None:
        error, status = None, "UNAVAILABLE"
        try:
            await s.watch(self._handoff(s))
        except Aborted:
            return  # the engine forgot the request already
        except asyncio.CancelledError:
            if s.aborted:  # the byte stream's call, cancelled by the ranges' Aborted
                return
            raise
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                error, status = self._late(s), "DEADLINE_EXCEEDED"
            else:
                error = (f"the handoff to the decode scheduler at {s.bootstrap} failed: {exc.code().name}: "
                         f"{exc.details()}")
                status = "CANCELLED" if exc.code() == grpc.StatusCode.NOT_FOUND else "UNAVAILABLE"
        except (TimeoutError, asyncio.TimeoutError):  # the deadline, or a transfer engine's own
            error, status = self._late(s), "DEADLINE_EXCEEDED"
        except TransferError as exc:
            error = f"the handoff to the decode scheduler at {s.bootstrap} failed: {exc}"
        finally:
            # Ended. Kept while the engine may still hand it something (a failure before the
            # handoff came), so that a late handoff does not open it again.
            s.ended = True
            if s.handoff is not None or s.aborted:
                self.sessions.pop(s.rid, None)
        if error is not None:
            log.warning("request %s: %s", s.rid, error)
        self.loop.call(lambda: self.loop.engine.disagg.handed(s.rid, error, status))

    async def _handoff(self, s: Session) -> None:
        """Reserve, move every range as it comes, then commit (raises what ``_send`` reports)."""
        channel = self._channel(s.bootstrap)
        stub = disagg_pb2_grpc.DisaggStub(channel)
        reservation = await stub.Reserve(disagg_pb2.KvReserveRequest(rid=s.rid, num_tokens=s.num_tokens,
                                                                     layout=self.layout), metadata=self.metadata)
        if (transfer := self._engines.get(reservation.transfer_engine)) is None:
            raise TransferError(f"its transfer engine {reservation.transfer_engine!r} is not this scheduler's "
                                f"({self.transfer.name}): set the same --disaggregation-transfer-backend on both")
        sent = await transfer.send(channel, self.metadata, s.rid, self.loop.engine.kv_pool, s, reservation, None)
        assert s.handoff is not None  # the ranges end only with it
        commit = disagg_pb2.KvCommit()
        commit.CopyFrom(s.handoff.commit)
        commit.transfer_s, commit.transfer_bytes = s.busy_s, sent
        await stub.Commit(commit, metadata=self.metadata)
        self.bytes_sent += sent
        self.seconds += commit.transfer_s

    def _late(self, s: Session) -> str:
        return (f"the KV transfer to the decode scheduler at {s.bootstrap} did not finish within {self.timeout_s:g} s "
                "(--disaggregation-transfer-timeout)")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for channel in self._channels.values():
            await channel.close()


def disagg_reads(mode: str, loop: EngineLoop, sender: KvSender | None) -> list[Read]:
    """The scheduler's disaggregation metrics: its role, and the KV it moved (prefill side: sent;
    decode side: received and committed)."""
    state = loop.engine.disagg
    return [
        Read("disaggregation_role", "--disaggregation-mode: 0 null (prefill and decode), 1 prefill, 2 decode.",
             "gauge", lambda: ("null", "prefill", "decode").index(mode)),
        Read("kv_transfer_bytes", "KV bytes moved between a prefill and a decode scheduler (sent here, or "
             "received here).", "counter", lambda: sender.bytes_sent if sender else state.transfer_bytes),
        Read("kv_transfer_seconds", "Seconds KV transfers took, summed (the sender's own time on each range of "
             "rows, not the wait for the decode side's reservation or for the next chunk).", "counter",
             lambda: sender.seconds if sender else state.transfer_seconds),
        Read("num_requests_transferring", "Decode side: requests holding a reservation that waits for its KV.",
             "gauge", lambda: len(state.reserved)),
    ]


def register(metrics: ServiceMetrics, mode: str, loop: EngineLoop, sender: KvSender | None) -> None:
    """Add ``disagg_reads`` to the scheduler's metrics."""
    metrics.add_reads(disagg_reads(mode, loop, sender))


class Served:
    """What ``serve`` sets up: the ``Disagg`` registration for ``start_server`` and the sender."""

    def __init__(self, registration: tuple, sender: KvSender):
        self.registration = registration
        self.sender = sender


def serve(cfg, loop: EngineLoop, metrics: ServiceMetrics) -> Served:
    """Both sides of a scheduler (``cfg``: its SchedulerConfig; in the running event loop): the
    ``Disagg`` servicer, the sender, the handoff deadline and the metrics. A scheduler in a
    prefill or decode role uses ``--disaggregation-transfer-backend``, attached to its KV pool;
    one that does both, or whose pool is on a GPU (mooncake's build here moves host memory),
    streams through gRPC. A decode side's reservation names its engine: the sender follows it."""
    backend = cfg.disaggregation_transfer_backend if cfg.disaggregation_mode != "null" else "grpc"
    device = loop.engine.kv_pool.k_buffer[0].device
    if backend == "mooncake" and device.type != "cpu":
        log.warning("the mooncake KV transfer engine here (Mooncake's non-CUDA build) moves host memory and the KV "
                    "pool is on %s: its KV moves through gRPC (the grpc engine)", device)
        backend = "grpc"
    transfer = make_transfer(backend, loop.engine.runtime.to_device)
    transfer.attach(loop.engine.kv_pool, cfg.host)
    loop.engine.disagg.timeout_s = cfg.disaggregation_transfer_timeout_s
    loop.engine.disagg.one_sided = transfer.one_sided
    sender = KvSender(loop, transfer, cfg.internal_auth.metadata(), cfg.disaggregation_transfer_timeout_s)
    register(metrics, cfg.disaggregation_mode, loop, sender if cfg.disaggregation_mode == "prefill" else None)
    name = disagg_pb2.DESCRIPTOR.services_by_name["Disagg"].full_name
    return Served((disagg_pb2_grpc.add_DisaggServicer_to_server, DisaggServicer(loop, transfer), name), sender)
