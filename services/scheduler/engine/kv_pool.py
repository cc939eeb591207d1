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
    """``req_to_token`` int32 [max_reqs, max_context]: req slot -> KV pool rows by position."""

    def __init__(self, max_reqs: int, max_context: int):
        self.size = max_reqs
        self.req_to_token = torch.zeros(max_reqs, max_context, dtype=torch.int32)
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


class TokenToKVPool:
    """Per-layer K and V buffers [size, kv_heads, head_dim] plus a free list of token rows.

    Buffers are allocated with ``torch.empty``: the OS commits pages as tokens are first
    written, so a generous ``size`` costs address space, not resident memory, until used.
    """

    def __init__(self, size: int, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
        self.size = size
        self.k_buffer = [torch.empty(size, kv_heads, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.v_buffer = [torch.empty(size, kv_heads, head_dim, dtype=dtype) for _ in range(num_layers)]
        self._free_slots = torch.arange(size, dtype=torch.int64)

    @property
    def available(self) -> int:
        return int(self._free_slots.numel())

    @property
    def used(self) -> int:
        return self.size - self.available

    def alloc(self, n: int) -> torch.Tensor:
        """Take ``n`` token rows -> int64 [n]. Raises RuntimeError when fewer are free."""
        if n > self._free_slots.numel():
            raise RuntimeError(f"KV pool exhausted: need {n} tokens, {self.available} free")
        out, self._free_slots = self._free_slots[:n], self._free_slots[n:]
        return out

    def free(self, rows: torch.Tensor) -> None:
        """Return token rows (any int dtype, 1-D) to the free list."""
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
                   kv_cache_mem_fraction: float, available_bytes: int | None = None) -> int:
    """Size of the KV pool in tokens, from the first setting given.

    Args:
        bytes_per_token: ``kv_bytes_per_token`` of the model and KV dtype.
        max_total_tokens: an explicit size in tokens (``--max-total-tokens``).
        kv_cache_gib: a size in GiB (``--kv-cache-gib``).
        kv_cache_mem_fraction: otherwise this fraction of ``available_bytes``, measured after
            the weights are loaded (``--kv-cache-mem-fraction``; SGLang's
            ``mem_fraction_static`` sizes its pool the same way on GPUs).
        available_bytes: default ``available_memory_bytes()``.

    Raises:
        ValueError: the size comes to less than one token.
    """
    if max_total_tokens is not None:
        tokens, source = max_total_tokens, f"--max-total-tokens {max_total_tokens}"
    elif kv_cache_gib is not None:
        tokens, source = int(kv_cache_gib * GIB) // bytes_per_token, f"--kv-cache-gib {kv_cache_gib:g}"
    else:
        free = available_memory_bytes() if available_bytes is None else available_bytes
        tokens = int(kv_cache_mem_fraction * free) // bytes_per_token
        source = f"--kv-cache-mem-fraction {kv_cache_mem_fraction:g} of {free / GIB:.2f} GiB available"
    if tokens < 1:
        raise ValueError(f"the KV pool would hold {tokens} tokens ({source}, {bytes_per_token} bytes per token)")
    return tokens
