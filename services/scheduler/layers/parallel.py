"""Tensor parallelism over ``torch.distributed``: the group and its collectives.

The layers that hold a shard of each weight, and load it, are ``layers.parallel_linear``
(Megatron-LM's layout: column-parallel q/k/v and gate/up, row-parallel o and down summed by
one all-reduce each, vocabulary-parallel embedding and LM head whose logits' shards are
all-gathered). KV heads are split when there are at least as many as ranks; otherwise each
is replicated on ``N / Hkv`` consecutive ranks (``local_kv_heads``), as SGLang does, so a
rank's query heads always find their KV head locally.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from services.scheduler.executor.device import DeviceRuntime


class RankFailure(RuntimeError):
    """A collective failed: another rank of the tensor-parallel group died or timed out."""


@dataclass
class TensorParallel:
    """This process's place in its tensor-parallel group.

    Attributes:
        rank: 0..size-1; rank 0 is the scheduler (gRPC, planning, sampling).
        size: ranks in the group (``--tp-size``).
        group: the ``torch.distributed`` process group of the collectives (None when size is 1).
        cpu_group: a gloo group for the per-step plan broadcast (the default group on the CPU).
        fixed_order: all-reduce by all-gather and a sum in rank order (deterministic
            inference, set by the engine and the worker ranks once the model is loaded). A
            ring all-reduce sums each element in an order set by which chunk of the buffer
            it falls in, and the chunks follow the buffer's size, that is the step's token
            count: a token's bf16 sum then changed with its batch (measured at tp 3: 10 of 18
            greedy answers differed between cold, cached and batched runs).
    """

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    fixed_order: bool = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it (``x`` itself when size is 1).

        With ``fixed_order`` every rank gathers the others' tensors and adds them in rank
        order (in x's dtype, left to right), so an element's sum does not depend on x's size.

        Raises:
            RankFailure: a peer closed its connection or the group's timeout passed.
        """
        if self.size == 1:
            return x
        try:
            if self.fixed_order:
                parts = [torch.empty_like(x) for _ in range(self.size)]
                dist.all_gather(parts, x.contiguous(), group=self.group)
                total = parts[0]
                for part in parts[1:]:
                    total = total.add_(part)
                return torch.ops.aten.copy_(x, total)
            dist.all_reduce(x, group=self.group)
        except (RuntimeError, dist.DistError) as exc:
            raise RankFailure(f"tensor-parallel all-reduce failed: {exc}") from exc
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Every rank's vocabulary shard [N, Vp] -> the whole logits [N, vocab_size] on every rank.

        Raises:
            RankFailure: as ``all_reduce``.
        """
        if self.size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        try:
            dist.all_gather(parts, logits.contiguous(), group=self.group)
        except (RuntimeError, dist.DistError) as exc:
            raise RankFailure(f"tensor-parallel all-gather failed: {exc}") from exc
        return torch.cat(parts, dim=-1).narrow(-1, 0, vocab_size)


def init_tensor_parallel(rank: int, size: int, addr: str, port: int, runtime: DeviceRuntime,
                         timeout_s: float) -> TensorParallel:
    """Join the group at ``tcp://addr:port`` (rank 0 hosts the store) with the runtime's
    collectives backend (``DeviceRuntime.dist_backend``: NCCL on CUDA, gloo on the CPU).

    Args:
        runtime: this rank's device runtime (``bind`` makes its device current, as NCCL needs).

    Every collective (and the rendezvous) raises after ``timeout_s`` rather than waiting for
    a rank that is gone. On CUDA a second, gloo group carries the per-step plan (host data).
    """
    if size == 1:
        return TensorParallel()
    backend = runtime.dist_backend
    runtime.bind()
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size,
                            timeout=timeout)
    group = dist.group.WORLD
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return TensorParallel(rank, size, group, cpu_group)


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads each rank holds: its share, or one replicated head when there are fewer than ranks."""
    return max(1, num_kv_heads // size)


def vocab_shard_size(vocab_size: int, size: int) -> int:
    """Rows of each rank's vocabulary shard (the last one padded): ceil(V / N)."""
    return -(-vocab_size // size)
