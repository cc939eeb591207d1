"""The two KV transfer engines moving one request's rows between two processes, on one machine.

    .venv/bin/python bench/kv_transfer.py [--mib 64] [--page 16] [--repeat 5]

A decode side in a process of its own holds a KV pool shaped as SmolLM2-135M's in bf16 (30
layers, 3 KV heads of 64) and serves both engines: ``grpc`` (its ``Disagg.PushKv`` on a gRPC
server, ``GrpcKvTransfer.receive`` into its rows) and ``mooncake`` (its pool registered with
Mooncake's transfer engine). This process sends one request's rows, ``--mib`` MiB of K plus V,
with each engine's ``send`` into the same reserved rows, ``--repeat`` times each: the rows on
both sides are runs of ``--page`` consecutive rows in shuffled order, as a paged pool hands
them out after some churn (``--page 0``: one run). The bytes that landed are checked after each
engine. Prints each engine's best and median time, GB/s, and the ratio grpc / mooncake.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ringserve import grpcutil  # noqa: E402
from ringserve.v1 import disagg_pb2, disagg_pb2_grpc  # noqa: E402
from services.scheduler.disagg.mooncake import MooncakeKvTransfer, row_runs  # noqa: E402
from services.scheduler.disagg.transfer import GrpcKvTransfer, KvLayout, whole  # noqa: E402
from services.scheduler.policy.kv_pool import TokenToKVPool  # noqa: E402

LAYERS, HEADS, DIM, DTYPE = 30, 3, 64, torch.bfloat16


def _rows(tokens: int, size: int, page: int, seed: int) -> torch.Tensor:
    """``tokens`` rows of a pool of ``size``: shuffled runs of ``page`` rows (one run with page 0)."""
    if page == 0:
        return torch.arange(tokens) + seed
    pages = torch.randperm(size // page, generator=torch.Generator().manual_seed(seed))[: -(-tokens // page)]
    return (pages[:, None] * page + torch.arange(page)).flatten()[:tokens]


def _checksum(pool: TokenToKVPool, rows: torch.Tensor) -> float:
    return sum(float(b[rows].double().sum()) for b in [*pool.k_buffer, *pool.v_buffer])


def peer(tokens: int, size: int, page: int) -> None:
    """The decode side: serve both engines into ``rows``; answer "sum" and "zero" on stdin."""
    pool = TokenToKVPool(size, LAYERS, HEADS, DIM, DTYPE)
    rows = _rows(tokens, size, page, seed=2)
    mooncake = MooncakeKvTransfer()
    mooncake.attach(pool, "127.0.0.1")
    grpc_engine = GrpcKvTransfer()

    class Servicer(disagg_pb2_grpc.DisaggServicer):
        async def PushKv(self, request_iterator, context):
            total = 0
            async for chunk in request_iterator:
                if chunk.k:  # an empty piece is mooncake's lease (as the scheduler's servicer reads it)
                    total += await asyncio.to_thread(grpc_engine.receive, pool, rows, chunk)
            return disagg_pb2.KvPushAck(bytes=total)

    def commands() -> None:
        for line in sys.stdin:
            if line.strip() == "zero":
                for b in [*pool.k_buffer, *pool.v_buffer]:
                    b[rows] = 0
                print("ok", flush=True)
            elif line.strip() == "sum":
                print(_checksum(pool, rows), flush=True)

    async def serve() -> None:
        server = grpc.aio.server()  # a piece is at most CHUNK_BYTES: gRPC's default cap holds it
        disagg_pb2_grpc.add_DisaggServicer_to_server(Servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, mooncake.bootstrap().hex(), flush=True)
        threading.Thread(target=commands, daemon=True).start()
        await server.wait_for_termination()

    asyncio.run(serve())


async def bench(args: argparse.Namespace, tokens: int, size: int, row_bytes: int) -> None:
    """Both engines' sends from this process into the peer's rows (see the module docstring)."""
    proc = subprocess.Popen([sys.executable, __file__, "--peer", "--mib", str(args.mib), "--page", str(args.page)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port, boot = proc.stdout.readline().split()
        pool = TokenToKVPool(size, LAYERS, HEADS, DIM, DTYPE)
        for b in [*pool.k_buffer, *pool.v_buffer]:
            b.copy_(torch.randn(b.shape))
        src = _rows(tokens, size, args.page, seed=1)
        want = _checksum(pool, src)
        dst = _rows(tokens, size, args.page, seed=2)
        reservation = disagg_pb2.KvReservation(rid="r", kv_rows=dst.tolist(), engine_bootstrap=bytes.fromhex(boot))
        mooncake = MooncakeKvTransfer()
        mooncake.attach(pool, "127.0.0.1")
        channel = grpcutil.channel(f"127.0.0.1:{port}")
        moved = 2 * LAYERS * tokens * KvLayout.of(pool).row_bytes
        times: dict[str, list[float]] = {}
        for engine in (GrpcKvTransfer(), mooncake):
            proc.stdin.write("zero\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "ok"
            for _ in range(args.repeat):
                started = time.perf_counter()
                assert await engine.send(channel, (), "r", pool, whole(src), reservation, 120.0) == moved
                times.setdefault(engine.name, []).append(time.perf_counter() - started)
            proc.stdin.write("sum\n")
            proc.stdin.flush()
            got = float(proc.stdout.readline())
            assert got == want, (engine.name, got, want)
        await channel.close()
    finally:
        proc.kill()
        proc.wait()
    runs = len(row_runs(src, dst)[0])
    print(f"{moved / 2**20:.1f} MiB: {tokens} rows x {LAYERS} layers x K,V of {row_bytes} B; rows in runs of "
          f"{args.page or tokens} ({runs} runs per buffer); {args.repeat} sends per engine, bytes checked")
    for name, ts in times.items():
        print(f"{name:>9}: best {min(ts) * 1e3:7.1f} ms  median {statistics.median(ts) * 1e3:7.1f} ms  "
              f"{moved / min(ts) / 1e9:5.2f} GB/s")
    print(f"grpc / mooncake (median): {statistics.median(times['grpc']) / statistics.median(times['mooncake']):.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    row_bytes = HEADS * DIM * torch.finfo(DTYPE).bits // 8
    tokens = (args.mib << 20) // (2 * LAYERS * row_bytes)
    size = 2 * tokens + 64
    if args.peer:
        peer(tokens, size, args.page)
    else:
        asyncio.run(bench(args, tokens, size, row_bytes))


if __name__ == "__main__":
    main()
