"""The ``mooncake`` transfer engine: the prefill side writes its KV rows straight into the rows
the decode side reserved, with Mooncake's transfer engine (TCP transport over host memory here;
the same calls use RDMA where Mooncake has it).

Each scheduler runs one Mooncake ``TransferEngine`` (``P2PHANDSHAKE`` metadata: no metadata
server; the session is ``host:port`` of the engine's handshake listener) and registers every
layer's K and V buffer of its KV pool with it. The decode side publishes its session and the
buffers' base addresses in the reservation (``MooncakeBootstrap``); the prefill side turns the
two page tables (its rows of the prompt, the reserved rows) into runs of rows consecutive on
both sides and writes each run of one layer's K or V with one request, a layer's requests in
one batch (``batch_transfer_sync_write``; several past ``MAX_BATCH``), layer by layer, range by
range as the prefill side's chunks come, while it holds a lease on the decode side (``send``)
on which it reports each range written. Nothing is packed or unpacked: the bytes go from the
prefill pool's rows to the decode pool's rows.

The engine's shared library links ``libibverbs.so.1``, ``libnl-3.so.200`` and
``libnl-route-3.so.200`` even for TCP: ``mooncake_native.load_engine`` loads them first.

Mooncake's non-CUDA build moves host memory: a KV pool on a GPU is refused (``service.serve``
uses ``grpc`` for one).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

from ringserve.v1 import disagg_pb2, disagg_pb2_grpc
from services.scheduler.disagg.mooncake_native import load_engine
from services.scheduler.disagg.transfer import KvLayout, KvTransfer, TransferError
from services.scheduler.policy.kv_pool import TokenToKVPool

WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
# Requests per batch: the TCP transport refuses a batch past its capacity (measured here: 1024
# requests went, 4096 did not), so a layer of many short runs goes in several.
MAX_BATCH = 1024


def row_runs(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Runs of positions whose rows are consecutive on both sides.

    Args:
        src, dst: int64 [n] (host), the two pools' rows of positions 0 .. n-1.

    Returns:
        (src_start, dst_start, length), int64 [runs] each: run i covers rows
        src_start[i] .. src_start[i] + length[i] - 1 here and likewise from dst_start[i] there.
    """
    n = int(src.numel())
    if n == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return empty, empty, empty
    breaks = ((src[1:] - src[:-1]) != 1) | ((dst[1:] - dst[:-1]) != 1)
    starts = torch.cat((torch.zeros(1, dtype=torch.int64), breaks.nonzero().flatten() + 1))
    lengths = torch.diff(starts, append=torch.tensor([n]))
    return src[starts], dst[starts], lengths


class MooncakeKvTransfer(KvTransfer):
    """One-sided writes into the decode side's pool (see the module docstring). ``attach`` starts
    the Mooncake engine and registers the pool; a scheduler attaches once, before serving."""

    name = "mooncake"
    one_sided = True

    def __init__(self, to_device=None):
        super().__init__(to_device)
        self.engine: Any = None
        self.session = ""
        self.pool: TokenToKVPool | None = None

    def attach(self, pool: TokenToKVPool, host: str) -> None:
        """Start the engine on ``host`` (a wildcard address: this machine's name's address) and
        register every K and V buffer of ``pool``.

        Raises:
            RuntimeError: the engine cannot load or start, or registration failed.
            ValueError: the pool is not in host memory.
        """
        if pool.k_buffer[0].device.type != "cpu":
            raise ValueError(f"the mooncake transfer engine here (its non-CUDA build) moves host memory; this KV pool "
                             f"is on {pool.k_buffer[0].device}: use --disaggregation-transfer-backend grpc")
        host = socket.gethostbyname(socket.gethostname()) if host in WILDCARD_HOSTS else host
        self.engine = load_engine()()
        if self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError(f"the mooncake transfer engine did not start on {host}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        buffers = [*pool.k_buffer, *pool.v_buffer]
        if self.engine.batch_register_memory([b.data_ptr() for b in buffers], [b.nbytes for b in buffers]) != 0:
            raise RuntimeError("the mooncake transfer engine refused to register the KV pool's buffers")
        self.pool = pool

    def bootstrap(self) -> bytes:
        pool = self._attached()
        k = pool.k_buffer[0]
        return disagg_pb2.MooncakeBootstrap(
            session=self.session, k_addrs=[b.data_ptr() for b in pool.k_buffer],
            v_addrs=[b.data_ptr() for b in pool.v_buffer], row_bytes=KvLayout.of(pool).row_bytes,
            buffer_rows=k.shape[0]).SerializeToString()

    def _attached(self) -> TokenToKVPool:
        if self.pool is None:
            raise RuntimeError("the mooncake transfer engine is not attached to a KV pool")
        return self.pool

    def write_layer(self, boot: disagg_pb2.MooncakeBootstrap, runs: tuple[torch.Tensor, ...], layer: int) -> int:
        """Write K and V of one layer's row runs (``row_runs``) into the peer's buffers; blocks
        until the peer acknowledged. Returns the bytes written.

        Raises:
            TransferError: Mooncake reported a failure (the peer gone or unreachable).
        """
        pool = self._attached()
        row_bytes = boot.row_bytes
        src, dst, lengths = (t * row_bytes for t in runs)
        srcs: list[int] = []
        dsts: list[int] = []
        for here, there in ((pool.k_buffer[layer].data_ptr(), boot.k_addrs[layer]),
                            (pool.v_buffer[layer].data_ptr(), boot.v_addrs[layer])):
            srcs += (src + here).tolist()
            dsts += (dst + there).tolist()
        sizes = lengths.tolist() * 2
        for i in range(0, len(sizes), MAX_BATCH):
            end = i + MAX_BATCH
            if self.engine.batch_transfer_sync_write(boot.session, srcs[i:end], dsts[i:end], sizes[i:end]) != 0:
                raise TransferError(f"the mooncake transfer engine failed to write layer {layer}'s KV to "
                                    f"{boot.session} (the decode scheduler gone?)")
        return sum(sizes)

    def plan(self, pool: TokenToKVPool, src_rows: torch.Tensor, reservation: disagg_pb2.KvReservation,
             first: int = 0) -> tuple[disagg_pb2.MooncakeBootstrap, tuple[torch.Tensor, ...]]:
        """The peer's bootstrap and the row runs of one range (positions ``first`` ..
        ``first + len(src_rows) - 1``), both checked against this pool.

        Raises:
            TransferError: the reservation does not fit this pool's layout or the range.
        """
        boot = disagg_pb2.MooncakeBootstrap.FromString(reservation.engine_bootstrap)
        layout = KvLayout.of(pool)
        n = int(src_rows.numel())
        if (boot.row_bytes != layout.row_bytes or len(boot.k_addrs) != layout.num_layers
                or len(boot.v_addrs) != layout.num_layers):
            raise TransferError(f"the decode side's mooncake buffers ({len(boot.k_addrs)} layers of {boot.row_bytes}-"
                                f"byte rows) do not fit this pool's {layout.num_layers} layers of {layout.row_bytes}")
        reserved = len(reservation.kv_rows)
        dst_rows = torch.tensor(reservation.kv_rows[first : first + n], dtype=torch.int64)
        outside = bool(n) and (int(dst_rows.min()) < 0 or int(dst_rows.max()) >= boot.buffer_rows)
        if first < 0 or first + n > reserved or outside:
            raise TransferError(f"the reservation's {reserved} rows do not fit prompt positions "
                                f"{first}..{first + n - 1} in a pool of {boot.buffer_rows} rows")
        return boot, row_runs(src_rows.to(torch.int64), dst_rows)

    async def write(self, pool: TokenToKVPool, src_rows: torch.Tensor, reservation: disagg_pb2.KvReservation,
                    timeout_s: float | None, first: int = 0) -> int:
        """K and V of ``src_rows`` (int64 [n], host: the rows of positions ``first`` ..
        ``first + n - 1``) into the reservation's rows of those positions, layer by layer;
        returns the bytes written.

        Raises:
            TransferError: the reservation does not fit, or a write failed.
            asyncio.TimeoutError: not done within ``timeout_s`` (None: the caller bounds it).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        boot, runs = self.plan(pool, src_rows, reservation, first)
        sent = 0
        for layer in range(len(pool.k_buffer)):
            # Off the event loop, and a deadline between layers: a stalled peer ends the handoff.
            layer_write = asyncio.to_thread(self.write_layer, boot, runs, layer)
            if deadline is None:
                sent += await layer_write
            else:
                sent += await asyncio.wait_for(layer_write, max(0.01, deadline - time.monotonic()))
        return sent

    async def send(self, channel, metadata, rid, pool, ranges, reservation, timeout_s):
        # The writes happen under a lease: a PushKv stream, open while they run, that reports
        # each range once written. Its end (or this process's death) tells the decode side no
        # write is landing any more, so it frees an aborted reservation's rows at once rather
        # than at its deadline; the reports let it refuse a commit short of the prompt.
        reports: asyncio.Queue[disagg_pb2.KvChunk | None] = asyncio.Queue()

        async def lease() -> AsyncIterator[disagg_pb2.KvChunk]:
            yield disagg_pb2.KvChunk(rid=rid)
            while (report := await reports.get()) is not None:
                yield report

        call = disagg_pb2_grpc.DisaggStub(channel).PushKv(lease(), timeout=timeout_s, metadata=metadata)
        sent = 0
        try:
            async for first, src_rows in ranges:
                sent += await self.write(pool, src_rows, reservation, timeout_s, first)
                reports.put_nowait(disagg_pb2.KvChunk(rid=rid, start=first, written=int(src_rows.numel())))
        except BaseException:
            call.cancel()
            raise
        reports.put_nowait(None)
        await call  # the decode side has counted every report before the commit
        return sent
