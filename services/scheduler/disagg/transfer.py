"""Moving a request's KV rows from the prefill side's pool into the rows the decode side reserved.

One interface, ``KvTransfer``, and its engines by name (``ENGINES``). Rows are addressed by
the KV pool's row index on both sides (the page table: ``req_to_token`` on the prefill side,
the ``KvReservation`` on the decode side), so neither side repacks a request's cache into a
staging buffer of its own.

A handoff's rows come as ranges of prompt positions (``Range``), chunk by chunk while the
prefill side still computes the next chunk, and each engine moves a range as it arrives.

``grpc`` streams the bytes over the decode scheduler's gRPC server (``Disagg.PushKv``): layer
by layer, each layer in pieces of at most ``CHUNK_BYTES``; the sender gathers a piece's rows
with one ``index_select`` per K and V (the byte stream needs them contiguous) and the receiver
scatters them into its rows with one ``index_copy_`` each. It needs nothing beyond the ring.
``mooncake`` (``disagg/mooncake.py``) writes the rows in place with Mooncake's transfer engine
instead: one-sided writes from this pool's rows into the reserved rows, no bytes through gRPC.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

import grpc
import torch

from ringserve.v1 import disagg_pb2, disagg_pb2_grpc
from services.scheduler.policy.kv_pool import TokenToKVPool

CHUNK_BYTES = 1 << 20  # K plus V bytes of one PushKv message at most (gRPC's default cap is 4 MiB)

# A range of a handoff: (first prompt position, int64 [n] host: this pool's rows of positions
# first .. first + n - 1).
Range = tuple[int, torch.Tensor]


async def whole(src_rows: torch.Tensor) -> AsyncIterator[Range]:
    """The whole prompt as one range (a handoff without chunks)."""
    yield 0, src_rows


@dataclass(frozen=True)
class KvLayout:
    """The shape of a KV row: both sides must agree before a byte moves.

    Attributes:
        num_layers: layers (each with a K and a V buffer).
        row_bytes: bytes of one token's K (or V) in one layer: kv_heads * head_dim * itemsize.
        dtype: the KV dtype's torch name ("float32", "bfloat16", ...).
    """

    num_layers: int
    row_bytes: int
    dtype: str

    @classmethod
    def of(cls, pool: TokenToKVPool) -> KvLayout:
        k = pool.k_buffer[0]
        return cls(len(pool.k_buffer), k.shape[1] * k.shape[2] * k.element_size(), str(k.dtype).removeprefix("torch."))

    @classmethod
    def from_proto(cls, msg: disagg_pb2.KvLayout) -> KvLayout:
        return cls(msg.num_layers, msg.row_bytes, msg.dtype)

    def to_proto(self) -> disagg_pb2.KvLayout:
        return disagg_pb2.KvLayout(num_layers=self.num_layers, row_bytes=self.row_bytes, dtype=self.dtype)

    def mismatch(self, other: KvLayout) -> str | None:
        """Why ``other`` (the peer's) cannot exchange rows with this one; None when it can."""
        if other == self:
            return None
        return (f"KV layout mismatch: this side has {self.num_layers} layers of {self.row_bytes}-byte {self.dtype} "
                f"rows, the peer {other.num_layers} of {other.row_bytes}-byte {other.dtype} rows (same model, dtype "
                "and --tp-size on both sides are needed)")


class TransferError(Exception):
    """A transfer engine could not move the rows (the peer gone, its buffers not matching); the
    handoff ends with UNAVAILABLE and this message."""


class KvTransfer(ABC):
    """A transfer engine. The decode side publishes ``bootstrap()`` in its reservation; the
    prefill side calls ``send``; an engine that streams bytes has the decode side ``receive``
    them, through ``to_device``: the receive path's one host-to-device copy
    (``DeviceRuntime.to_device``, non-blocking from pinned memory on CUDA; None: ``.to`` the
    pool's device)."""

    name: ClassVar[str]
    one_sided: ClassVar[bool] = False  # the sender writes into the reserved rows itself (no receive)

    def __init__(self, to_device: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.to_device = to_device

    @abstractmethod
    def attach(self, pool: TokenToKVPool, host: str) -> None:
        """Make ``pool`` reachable by the peer's engine: a scheduler attaches once, before
        serving; ``host`` is its listen address."""

    @abstractmethod
    def bootstrap(self) -> bytes:
        """Decode side: what the sender needs to reach this pool's rows (``KvReservation.engine_bootstrap``)."""

    @abstractmethod
    async def send(self, channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]], rid: str,
                   pool: TokenToKVPool, ranges: AsyncIterable[Range], reservation: disagg_pb2.KvReservation,
                   timeout_s: float | None) -> int:
        """Prefill side: copy K and V of each range's rows, as the ranges come, into the
        reservation's rows of the same positions; returns the bytes moved. An exception the
        ranges raise (the request aborted) ends the send between ranges, and propagates.

        Raises:
            grpc.aio.AioRpcError: the decode side refused the rows or was unreachable.
            TransferError: the engine could not write the rows.
            asyncio.TimeoutError: not done within ``timeout_s`` (None: the caller bounds it).
        """

    def receive(self, pool: TokenToKVPool, dst_rows: torch.Tensor, chunk: disagg_pb2.KvChunk) -> int:
        """Decode side: write one streamed piece into ``dst_rows`` (int64, the reservation's
        rows by position); returns its bytes. Engines with one-sided writes stream nothing.

        Raises:
            ValueError: the piece does not fit the reservation or the layout.
        """
        raise ValueError(f"the {self.name} transfer engine does not stream bytes")


def _rows_bytes(buf: torch.Tensor, rows: torch.Tensor) -> bytes:
    """K or V of ``rows`` of one layer's buffer, contiguous, as bytes (one device-to-host copy)."""
    return buf.index_select(0, rows.to(buf.device)).contiguous().view(torch.uint8).cpu().numpy().tobytes()


def pieces(layout: KvLayout, num_tokens: int) -> Iterator[tuple[int, int, int]]:
    """The (layer, start, end) positions of each ``grpc`` piece: layer by layer, each layer in
    runs of at most ``CHUNK_BYTES`` of K plus V."""
    per_piece = max(1, CHUNK_BYTES // (2 * layout.row_bytes))
    for layer in range(layout.num_layers):
        for start in range(0, num_tokens, per_piece):
            yield layer, start, min(start + per_piece, num_tokens)


def pack(pool: TokenToKVPool, rid: str, src_rows: torch.Tensor, layer: int, start: int, end: int,
         first: int = 0) -> disagg_pb2.KvChunk:
    """The piece of ``layer``: K and V of ``src_rows[start:end]``, the rows of positions
    ``first + start`` .. ``first + end - 1`` (``first``: the range's first position)."""
    rows = src_rows[start:end]
    return disagg_pb2.KvChunk(rid=rid, layer=layer, start=first + start, k=_rows_bytes(pool.k_buffer[layer], rows),
                              v=_rows_bytes(pool.v_buffer[layer], rows))


class GrpcKvTransfer(KvTransfer):
    """Streams the rows over the decode scheduler's ``Disagg.PushKv`` (see the module docstring)."""

    name = "grpc"

    def attach(self, pool, host):
        pass  # the rows are reached through the scheduler's gRPC server

    def bootstrap(self) -> bytes:
        return b""

    async def send(self, channel, metadata, rid, pool, ranges, reservation, timeout_s):
        async def chunks() -> AsyncIterator[disagg_pb2.KvChunk]:
            async for first, src_rows in ranges:
                for layer, start, end in pieces(KvLayout.of(pool), int(src_rows.numel())):
                    # Off the event loop: a piece is up to CHUNK_BYTES of copying.
                    yield await asyncio.to_thread(pack, pool, rid, src_rows, layer, start, end, first)

        stub = disagg_pb2_grpc.DisaggStub(channel)
        ack = await stub.PushKv(chunks(), timeout=timeout_s, metadata=metadata)
        return int(ack.bytes)

    def receive(self, pool, dst_rows, chunk):
        layout = KvLayout.of(pool)
        n, extra = divmod(len(chunk.k), layout.row_bytes)
        if extra or len(chunk.v) != len(chunk.k) or not 0 <= chunk.layer < layout.num_layers:
            raise ValueError(f"a KV piece of layer {chunk.layer} with {len(chunk.k)}/{len(chunk.v)} bytes does not "
                             f"fit {layout.num_layers} layers of {layout.row_bytes}-byte rows")
        if chunk.start < 0 or chunk.start + n > dst_rows.numel():
            raise ValueError(f"KV positions {chunk.start}..{chunk.start + n - 1} are outside the "
                             f"{dst_rows.numel()} reserved rows")
        k, v = pool.k_buffer[chunk.layer], pool.v_buffer[chunk.layer]
        move = self.to_device or (lambda t: t.to(k.device, non_blocking=True))
        # Raw bytes go to the device as they are and are viewed there as K and V rows: the
        # step never waits on this copy, and nothing is read back.
        host = torch.frombuffer(bytearray(chunk.k + chunk.v), dtype=torch.uint8)
        k_rows, v_rows = move(host).view(k.dtype).view(2, n, *k.shape[1:]).unbind(0)
        rows = move(dst_rows[chunk.start : chunk.start + n])
        k.index_copy_(0, rows, k_rows)
        v.index_copy_(0, rows, v_rows)
        return 2 * len(chunk.k)

