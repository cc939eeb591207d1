"""The ``mooncake`` transfer engine: a request's K and V rows written from one KV pool into the
rows another pool reserved, through Mooncake's TCP transport, land there and nowhere else; the
prefill scheduler's sender writes them under a lease and commits after it; a decode side that
stalls or dies mid-handoff ends the send with a clear error, not a hang."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from ringserve.v1 import common_pb2, disagg_pb2, disagg_pb2_grpc
from services.scheduler.disagg.handoff import Handoff
from services.scheduler.disagg.mooncake import MooncakeKvTransfer, row_runs
from services.scheduler.disagg.service import KvSender
from services.scheduler.disagg.transfer import KvLayout, TransferError
from services.scheduler.policy.kv_pool import TokenToKVPool
from tests.helpers.ring_requests import wait_until

LAYERS, HEADS, DIM, ROWS = 3, 2, 8, 64

# A decode side in a process of its own, without torch (it starts in a fraction of the time): a
# zeroed pool of LAYERS K and V buffers registered with its engine; it prints its bootstrap.
PEER = f"""
import ctypes
from ringserve.v1 import disagg_pb2
from services.scheduler.disagg.mooncake_native import load_engine
engine = load_engine()()
assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
row_bytes = {HEADS * DIM * 4}
bufs = [ctypes.create_string_buffer({ROWS + 1} * row_bytes) for _ in range({2 * LAYERS})]
addrs = [ctypes.addressof(b) for b in bufs]
assert engine.batch_register_memory(addrs, [len(b) for b in bufs]) == 0
print(disagg_pb2.MooncakeBootstrap(session=f"127.0.0.1:{{engine.get_rpc_port()}}", k_addrs=addrs[:{LAYERS}],
                                   v_addrs=addrs[{LAYERS}:], row_bytes=row_bytes,
                                   buffer_rows={ROWS + 1}).SerializeToString().hex(), flush=True)
input()
"""


def _pool(fill: float | None = None) -> TokenToKVPool:
    pool = TokenToKVPool(ROWS, LAYERS, HEADS, DIM, torch.float32)
    for layer, buf in enumerate([*pool.k_buffer, *pool.v_buffer]):
        if fill is None:
            buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).view(buf.shape) + 1000 * layer)
        else:
            buf.fill_(fill)
    return pool


def _reservation(dst_rows: list[int], bootstrap: bytes) -> disagg_pb2.KvReservation:
    return disagg_pb2.KvReservation(rid="r", kv_rows=dst_rows, transfer_engine="mooncake", engine_bootstrap=bootstrap)


def test_row_runs_are_consecutive_on_both_sides():
    src = torch.tensor([5, 6, 7, 20, 21, 3])
    dst = torch.tensor([10, 11, 12, 13, 40, 41])
    assert [t.tolist() for t in row_runs(src, dst)] == [[5, 20, 21, 3], [10, 13, 40, 41], [3, 1, 1, 1]]


@pytest.fixture(scope="module")
def engines() -> tuple[MooncakeKvTransfer, MooncakeKvTransfer]:
    """A prefill side's and a decode side's engine in this process (an engine takes a second to
    shut down: the module's tests share them)."""
    prefill, decode = MooncakeKvTransfer(), MooncakeKvTransfer()
    prefill.attach(_pool(), "127.0.0.1")
    decode.attach(_pool(fill=0.0), "127.0.0.1")
    return prefill, decode


async def test_rows_land_in_the_reserved_rows_and_nowhere_else(engines):
    prefill, decode = engines
    src_pool, dst_pool = prefill.pool, decode.pool
    src_rows = torch.tensor([5, 6, 7, 20, 21, 3, 30, 31, 32, 33])
    dst_rows = [10, 11, 12, 13, 40, 41, 50, 51, 52, 53]
    sent = await prefill.write(src_pool, src_rows, _reservation(dst_rows, decode.bootstrap()), 10.0)

    assert sent == 2 * LAYERS * len(dst_rows) * KvLayout.of(src_pool).row_bytes
    others = torch.ones(ROWS + 1, dtype=torch.bool)
    others[dst_rows] = False
    sent_bufs, got_bufs = [*src_pool.k_buffer, *src_pool.v_buffer], [*dst_pool.k_buffer, *dst_pool.v_buffer]
    for src, dst in zip(sent_bufs, got_bufs, strict=True):
        assert torch.equal(dst[dst_rows], src[src_rows])
        assert not dst[others].any()


async def test_a_reservation_that_does_not_fit_is_refused(engines):
    prefill, decode = engines
    with pytest.raises(TransferError, match="rows do not fit prompt positions 0..1 in a pool of 65 rows"):
        await prefill.write(prefill.pool, torch.tensor([1, 2]), _reservation([3, ROWS + 1], decode.bootstrap()), 10.0)


@pytest.mark.ring
async def test_a_stalled_or_dead_decode_side_ends_the_send_with_an_error(engines):
    prefill = engines[0]
    pool = prefill.pool
    peer = subprocess.Popen([sys.executable, "-c", PEER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        bootstrap = bytes.fromhex(peer.stdout.readline().decode())
        rows = torch.arange(32)
        reservation = _reservation(list(range(32)), bootstrap)
        assert await prefill.write(pool, rows, reservation, 10.0) > 0  # the peer is there

        peer.send_signal(signal.SIGSTOP)  # stalled: the deadline ends the send
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await prefill.write(pool, rows, reservation, 0.5)
        assert time.monotonic() - started < 2

        peer.kill()  # gone: Mooncake reports the failed write
        peer.wait()
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="failed to write layer 0's KV to 127.0.0.1:"):
            await prefill.write(pool, rows, reservation, 10.0)
        assert time.monotonic() - t0 < 5
    finally:
        peer.kill()
        peer.wait()


class Decode(disagg_pb2_grpc.DisaggServicer):
    """A decode scheduler's ``Disagg`` service that answers with ``reservation`` and records the
    lease stream's pieces and its end, and the commit."""

    def __init__(self, reservation: disagg_pb2.KvReservation):
        self.reservation = reservation
        self.events: list[tuple] = []

    async def Reserve(self, request, context):
        return self.reservation

    async def PushKv(self, request_iterator, context):
        async for chunk in request_iterator:
            if chunk.k:  # the grpc engine's piece
                self.events.append(("piece", chunk.rid, chunk.layer, chunk.start, len(chunk.k)))
            else:
                report = ("wrote", chunk.rid, chunk.start, chunk.written)
                self.events.append(report if chunk.written else ("lease", chunk.rid))
        self.events.append(("lease ended",))
        return disagg_pb2.KvPushAck()

    async def Commit(self, request, context):
        self.events.append(("commit", request.rid, request.transfer_bytes))
        return common_pb2.Empty()


async def _serve(service: Decode, prefill: MooncakeKvTransfer,
                 timeout_s: float) -> tuple[grpc.aio.Server, int, KvSender, list[tuple]]:
    """``service`` on a gRPC server of a free port, and a sender over ``prefill``'s pool whose
    stand-in engine records what it is ``handed``: (server, port, sender, the handed calls)."""
    server = grpc.aio.server()
    disagg_pb2_grpc.add_DisaggServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    handed: list[tuple] = []
    disagg = SimpleNamespace(handed=lambda *args: handed.append(args))
    loop = SimpleNamespace(engine=SimpleNamespace(kv_pool=prefill.pool, disagg=disagg), call=lambda fn: fn())
    return server, port, KvSender(loop, prefill, (), timeout_s), handed


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
async def test_the_sender_writes_under_a_lease_then_commits(engines, engine):
    prefill, decode = engines
    for buf in [*decode.pool.k_buffer, *decode.pool.v_buffer]:
        buf.zero_()
    src_rows, dst_rows = torch.tensor([40, 41, 42, 7]), [1, 2, 3, 4]
    service = Decode(disagg_pb2.KvReservation(rid="r", kv_rows=dst_rows, transfer_engine=engine,
                                              engine_bootstrap=decode.bootstrap()))
    server, port, sender, handed = await _serve(service, prefill, 10.0)
    try:  # opened at admission, the first chunk's rows, then the last with the first token
        sender.open("r", f"127.0.0.1:{port}", len(src_rows))
        sender._put("r", (0, src_rows[:3]))
        sender._put("r", Handoff("r", f"127.0.0.1:{port}", src_rows, disagg_pb2.KvCommit(rid="r", first_token=5), 3))
        await asyncio.gather(*sender._tasks)
    finally:
        await sender.close()
        await server.stop(0)
    moved = 2 * LAYERS * len(dst_rows) * KvLayout.of(prefill.pool).row_bytes
    if engine == "nixl":
        assert handed == [("r", f"the handoff to the decode scheduler at 127.0.0.1:{port} failed: its transfer engine "
                                "'nixl' is not this scheduler's (mooncake): set the same "
                                "--disaggregation-transfer-backend on both", "UNAVAILABLE")]
        assert service.events == [] and sender.bytes_sent == 0
        return
    assert handed == [("r", None, "UNAVAILABLE")]  # no error
    assert service.events == [("lease", "r"), ("wrote", "r", 0, 3), ("wrote", "r", 3, 1), ("lease ended",),
                              ("commit", "r", moved)]
    assert sender.bytes_sent == moved
    for src, dst in zip(prefill.pool.k_buffer, decode.pool.k_buffer, strict=True):
        assert torch.equal(dst[dst_rows], src[src_rows])


@pytest.mark.parametrize("end", ["deadline", "abort", "grpc deadline", "grpc abort"])
async def test_a_handoff_whose_next_range_never_comes_ends_and_its_stream_with_it(engines, end):
    prefill, decode = engines
    reservation = _reservation([1, 2, 3, 4], decode.bootstrap())
    if end.startswith("grpc"):
        reservation.transfer_engine = "grpc"
    service = Decode(reservation)
    server, port, sender, handed = await _serve(service, prefill, 0.3)
    try:
        sender.open("r", f"127.0.0.1:{port}", 4)
        sender._put("r", (0, torch.tensor([40, 41, 42])))  # the first chunk; the rest never comes
        if end.endswith("abort"):
            while len(service.events) < (2 if end == "abort" else LAYERS):
                await asyncio.sleep(0.01)
            sender._put("r", None)  # the request aborted on the prefill side: the sender stops here
        await asyncio.gather(*sender._tasks)
        # The decode side's handler sees the stream end after the sender's task is done: on a
        # starved process, stopping the server at once cancelled it before it did.
        await wait_until(lambda: ("lease ended",) in service.events, 10, "the lease's end seen by the decode side")
    finally:
        await sender.close()
        await server.stop(0)
    row_bytes = KvLayout.of(prefill.pool).row_bytes
    wrote = [("piece", "r", layer, 0, 3 * row_bytes) for layer in range(LAYERS)] if end.startswith("grpc") else [
        ("lease", "r"), ("wrote", "r", 0, 3)]
    assert service.events == [*wrote, ("lease ended",)]  # no commit
    if not end.endswith("abort"):  # kept until the engine's last word: a late handoff does not reopen it
        assert sender.sessions["r"].ended
        sender._put("r", None)
    assert sender.sessions == {} and handed == ([] if end.endswith("abort") else [(
        "r", f"the KV transfer to the decode scheduler at 127.0.0.1:{port} did not finish within 0.3 s "
             "(--disaggregation-transfer-timeout)", "DEADLINE_EXCEEDED")])
