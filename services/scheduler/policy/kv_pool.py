"""Request-slot table and token-granular paged KV cache.

Two-level memory as in SGLang (``ReqToTokenPool`` and ``TokenToKVPool`` with its free-list
allocator): a request holds one req slot, a row of the req-to-token table listing the KV
pool rows of its tokens in position order; the KV pool hands out single token rows from a
free list, so a request's cache need not be contiguous and nothing is fragmented.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import torch

GIB = 2**30


class ReqToTokenPool:
    """``req_to_token`` int32 [max_reqs + 1, max_context]: req slot -> KV pool rows by position.

    The table lives on the host, where the scheduler reads and writes it (admission, the
    prefix cache, release); ``device_table`` is its copy on the device, which attention
    reads. On the CPU the two are one tensor. On a device with memory of its own
    (``mirrored``: ``DeviceRuntime.mirrors_tables``) every write is also queued
    (``take_writes``) and the model runner applies the step's writes to the device copy
    inside its one host-to-device copy, so the device copy is up to date for every row a
    step reads.

    The last row (``pad_slot``) belongs to no request: padded rows of a CUDA-graph batch
    read it (every entry is ``pad_row`` of the KV pool, written at construction).

    Args:
        device: where ``device_table`` lives.
        pad_row: the KV pool's padding row (``TokenToKVPool.pad_row``).
        mirrored: ``device_table`` is a copy on ``device``, kept up to date from the writes.
        record_writes: queue the writes on the CPU too (tensor parallelism: each step carries
            them to the other ranks' tables).
    """

    def __init__(self, max_reqs: int, max_context: int, device: torch.device = torch.device("cpu"),
                 pad_row: int = 0, record_writes: bool = False, mirrored: bool = False):
        self.size = max_reqs
        self.pad_slot = max_reqs
        self.req_to_token = torch.zeros(max_reqs + 1, max_context, dtype=torch.int32)
        self.req_to_token[self.pad_slot] = pad_row
        self.mirrored = mirrored
        if self.mirrored:
            self.device_table = torch.full((max_reqs + 1, max_context), pad_row, dtype=torch.int32, device=device)
        else:
            self.device_table = self.req_to_token
        self.recorded = self.mirrored or record_writes
        self._writes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (flat index int64, rows int32)
        self._free = list(range(max_reqs - 1, -1, -1))

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.size - len(self._free)

    def alloc(self) -> int:
        """Take a free req slot. Raises RuntimeError when none is free (callers check ``available``)."""
        if not self._free:
            raise RuntimeError("no free request slot")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def reset(self) -> None:
        self._free = list(range(self.size - 1, -1, -1))
        self._writes.clear()

    def write(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """Positions ``start..start+len(rows)-1`` of ``slot`` now hold KV pool ``rows`` (int, 1-D, host)."""
        rows = rows.to(torch.int32)
        self.req_to_token[slot, start : start + rows.numel()] = rows
        if self.recorded and rows.numel():
            width = self.req_to_token.shape[1]
            self._writes.append((slot * width + start + torch.arange(rows.numel()), rows))

    def write_batch(self, slots: list[int], positions: list[int], rows: torch.Tensor) -> None:
        """Position ``positions[i]`` of ``slots[i]`` now holds KV pool row ``rows[i]`` (host)."""
        slots_t = torch.tensor(slots, dtype=torch.int64)
        pos_t = torch.tensor(positions, dtype=torch.int64)
        rows = rows.to(torch.int32)
        self.req_to_token[slots_t, pos_t] = rows
        if self.recorded and rows.numel():
            self._writes.append((slots_t * self.req_to_token.shape[1] + pos_t, rows))

    def take_writes(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The writes since the last call -> (flat indices int64 [N], rows int32 [N]) for
        ``device_table.view(-1)``; None when there are none (always on the CPU on one rank)."""
        if not self._writes:
            return None
        index = torch.cat([i for i, _ in self._writes])
        rows = torch.cat([r for _, r in self._writes])
        self._writes.clear()
        return index, rows


class TokenToKVPool:
    """Per-layer K and V buffers [size + 1, kv_heads, head_dim] on the device, plus a host
    free list of token rows.

    Row ``pad_row`` (the last) is never handed out: padded rows of a CUDA-graph batch write
    their K/V there. On the CPU the buffers are allocated with ``torch.empty``: the OS
    commits pages as tokens are first written, so a generous ``size`` costs address space,
    not resident memory, until used.
    """

    def __init__(self, size: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device = torch.device("cpu")):
        self.size = size
        self.pad_row = size
        shape = (size + 1, kv_heads, head_dim)
        self.k_buffer = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._free_slots = torch.arange(size, dtype=torch.int64)

    @property
    def available(self) -> int:
        return int(self._free_slots.numel())

    @property
    def used(self) -> int:
        return self.size - self.available

    def alloc(self, n: int) -> torch.Tensor:
        """Take ``n`` token rows -> int64 [n] (host). Raises RuntimeError when fewer are free."""
        if n > self._free_slots.numel():
            raise RuntimeError(f"KV pool exhausted: need {n} tokens, {self.available} free")
        out, self._free_slots = self._free_slots[:n], self._free_slots[n:]
        return out

    def free(self, rows: torch.Tensor) -> None:
        """Return token rows (any int dtype, 1-D, host) to the free list."""
        if rows.numel():
            self._free_slots = torch.cat((self._free_slots, rows.to(torch.int64)))

    def reset(self) -> None:
        self._free_slots = torch.arange(self.size, dtype=torch.int64)

    def bytes_per_token(self) -> int:
        k = self.k_buffer[0]
        return 2 * len(self.k_buffer) * k.shape[1] * k.shape[2] * k.element_size()


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's K and V take over every layer."""
    return 2 * num_layers * kv_heads * head_dim * dtype.itemsize


def available_memory_bytes(cgroup_dir: Path = Path("/sys/fs/cgroup")) -> int:
    """Memory this process can still take, in bytes: the host's MemAvailable (psutil), capped
    by the cgroup v2 limit minus current use when one is set (a Kubernetes pod's limit is
    invisible in /proc/meminfo)."""
    available = psutil.virtual_memory().available
    try:
        limit = (cgroup_dir / "memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit) - int((cgroup_dir / "memory.current").read_text()))
    except (FileNotFoundError, PermissionError, ValueError):
        pass  # no cgroup v2 memory controller here: the host figure stands
    return max(available, 0)


def kv_pool_tokens(bytes_per_token: int, max_total_tokens: int | None, kv_cache_gib: float | None,
                   default_bytes: int, default_source: str) -> int:
    """Size of the KV pool in tokens, from the first setting given.

    Args:
        bytes_per_token: ``kv_bytes_per_token`` of the model and KV dtype.
        max_total_tokens: an explicit size in tokens (``--max-total-tokens``).
        kv_cache_gib: a size in GiB (``--kv-cache-gib``).
        default_bytes: otherwise this many bytes (the device runtime's budget, see
            ``executor.device``); ``default_source`` says where the figure came from, for the error.

    Raises:
        ValueError: the size comes to less than one token.
    """
    if max_total_tokens is not None:
        tokens, source = max_total_tokens, f"--max-total-tokens {max_total_tokens}"
    elif kv_cache_gib is not None:
        tokens, source = int(kv_cache_gib * GIB) // bytes_per_token, f"--kv-cache-gib {kv_cache_gib:g}"
    else:
        tokens, source = max(default_bytes, 0) // bytes_per_token, default_source
    if tokens < 1:
        raise ValueError(f"the KV pool would hold {tokens} tokens ({source}, {bytes_per_token} bytes per token)")
    return tokens
