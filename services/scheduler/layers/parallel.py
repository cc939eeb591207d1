"""Tensor parallelism over ``torch.distributed``: the group, the shard of each weight, the collectives.

The layout is Megatron-LM's (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", section 3), as SGLang and vLLM serve it:

- column-parallel q/k/v and gate/up: rank r holds rows of the output dimension (its query
  heads, its KV heads, its slice of the intermediate size), so attention and the SiLU-and-mul
  run on local heads and local columns with no communication;
- row-parallel o and down: rank r holds the matching columns of the input dimension, and one
  all-reduce (sum) of the partial outputs gives every rank the full hidden state;
- vocabulary-parallel embedding and LM head: rank r holds vocabulary rows
  ``[r * Vp, (r + 1) * Vp)`` (``Vp = ceil(V / N)``, the last shard padded with zero rows); an
  embedding lookup outside the shard gives zeros and an all-reduce sums the one non-zero row;
  the logits' shards are all-gathered along the vocabulary and the padding cut off.

KV heads are split when there are at least as many as ranks; otherwise each is replicated on
``N / Hkv`` consecutive ranks (rank r holds KV head ``r * Hkv // N``), as SGLang does, so a
rank's query heads always find their KV head locally.

Weights are cut at load from the full checkpoint tensors (``shard_state``): every rank reads
the whole file and keeps its shard.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


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
    group: object = None
    cpu_group: object = None
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


def init_tensor_parallel(rank: int, size: int, addr: str, port: int, device: torch.device,
                         timeout_s: float) -> TensorParallel:
    """Join the group at ``tcp://addr:port`` (rank 0 hosts the store): NCCL on CUDA, gloo on the CPU.

    Args:
        device: this rank's device (on CUDA it becomes the current device, as NCCL needs).

    Every collective (and the rendezvous) raises after ``timeout_s`` rather than waiting for
    a rank that is gone. On CUDA a second, gloo group carries the per-step plan (host data).
    """
    if size == 1:
        return TensorParallel()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size,
                            timeout=timeout)
    group = dist.group.WORLD
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return TensorParallel(rank, size, group, cpu_group)


def check_divisible(cfg, size: int) -> None:
    """Refuse a model whose heads or intermediate size do not split over ``size`` ranks.

    ``cfg`` needs num_attention_heads, num_key_value_heads and intermediate_size (the
    vocabulary is padded, so any size fits).

    Raises:
        ValueError: naming the size that does not divide and ``--tp-size``.
    """
    if size < 1:
        raise ValueError(f"--tp-size {size} must be >= 1")
    heads, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if heads % size:
        raise ValueError(f"--tp-size {size} does not divide the model's {heads} attention heads")
    if kv >= size and kv % size:
        raise ValueError(f"--tp-size {size} does not divide the model's {kv} KV heads")
    if kv < size and size % kv:
        raise ValueError(f"--tp-size {size} is not a multiple of the model's {kv} KV heads "
                         "(needed to replicate them)")
    if inter % size:
        raise ValueError(f"--tp-size {size} does not divide the model's intermediate size {inter}")


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads each rank holds: its share, or one replicated head when there are fewer than ranks."""
    return max(1, num_kv_heads // size)


def vocab_shard_size(vocab_size: int, size: int) -> int:
    """Rows of each rank's vocabulary shard (the last one padded): ceil(V / N)."""
    return -(-vocab_size // size)


class VocabParallelEmbedding(torch.nn.Module):
    """Token embedding over this rank's vocabulary shard; the whole table when size is 1.

    Args:
        vocab_size: V of the model (the shard covers rows ``rank * Vp`` to ``rank * Vp + Vp - 1``).
        tp: the group; ``weight`` is [Vp, hidden], filled at load.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.num_local = vocab_shard_size(vocab_size, tp.size)
        self.start = tp.rank * self.num_local
        self.weight = torch.nn.Parameter(torch.empty(self.num_local, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [T] -> [T, hidden] in the weight's dtype (summed over the ranks)."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        valid = (local >= 0).logical_and(local < self.num_local)
        out = F.embedding(local.clamp(0, self.num_local - 1), self.weight)
        return self.tp.all_reduce(out.mul_(valid.unsqueeze(-1).to(out.dtype)))


def _rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return t.narrow(0, start, count)


def shard_qkv(w: torch.Tensor, heads: int, kv_heads: int, head_dim: int, tp: TensorParallel) -> torch.Tensor:
    """A fused [(Hq + 2 Hkv) * D, ...] q/k/v weight (or bias) -> this rank's
    [(Hq/N + 2 Hkv_local) * D, ...]: its query heads, its KV heads (split or replicated)."""
    q, k, v = w.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    hq = heads // tp.size
    hkv = local_kv_heads(kv_heads, tp.size)
    kv_start = tp.rank * hkv if kv_heads >= tp.size else tp.rank * kv_heads // tp.size
    return torch.cat([_rows(q, tp.rank * hq * head_dim, hq * head_dim),
                      _rows(k, kv_start * head_dim, hkv * head_dim),
                      _rows(v, kv_start * head_dim, hkv * head_dim)])


def shard_gate_up(w: torch.Tensor, intermediate: int, tp: TensorParallel) -> torch.Tensor:
    """A fused [2 I, hidden] gate/up weight -> this rank's [2 I/N, hidden] (its gate rows, then its up rows)."""
    n = intermediate // tp.size
    gate, up = w.split([intermediate, intermediate])
    return torch.cat([_rows(gate, tp.rank * n, n), _rows(up, tp.rank * n, n)])


def shard_columns(w: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A row-parallel weight [out, in] -> this rank's [out, in/N] (its input columns)."""
    n = w.shape[1] // tp.size
    return w.narrow(1, tp.rank * n, n)


def shard_vocab(w: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A [V, hidden] embedding or LM head -> this rank's [Vp, hidden], zero rows past V."""
    v = w.shape[0]
    n = vocab_shard_size(v, tp.size)
    start = tp.rank * n
    mine = w.narrow(0, min(start, v), max(0, min(n, v - start)))
    if mine.shape[0] == n:
        return mine
    return torch.cat([mine, w.new_zeros(n - mine.shape[0], w.shape[1])])


def shard_state(state: dict[str, torch.Tensor], cfg, tp: TensorParallel,
                device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Cut a Llama-family state dict (fused qkv_proj and gate_up_proj, this package's names)
    to rank ``tp.rank``'s shard, copied to ``device`` (default: where it is); each shard is a
    fresh tensor, so the full ones can be freed. Tied embeddings stay one tensor. The
    identity when size is 1."""
    if tp.size == 1:
        return state
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name == "lm_head.weight" and t is state.get("embed_tokens.weight"):
            continue
        if ".qkv_proj." in name:
            t = shard_qkv(t, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, tp)
        elif ".gate_up_proj." in name:
            t = shard_gate_up(t, cfg.intermediate_size, tp)
        elif ".o_proj." in name or ".down_proj." in name:
            t = shard_columns(t, tp)
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            t = shard_vocab(t, tp)
        out[name] = t.to(device if device is not None else t.device, copy=True)
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out
