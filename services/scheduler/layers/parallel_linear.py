"""Linear layers, embedding and LM head that load their own tensor-parallel shard.

The layout is Megatron-LM's (Shoeybi et al. 2019, section 3), as SGLang, vLLM and
nano-vllm serve it:

- column-parallel (``ColumnParallelLinear``, ``MergedColumnParallelLinear`` for gate/up,
  ``QKVParallelLinear``): rank r holds rows of the output dimension (its query heads, its
  KV heads, its slice of the intermediate size), so attention and the gated activation run
  on local heads and columns with no communication;
- row-parallel (``RowParallelLinear``: o_proj, down_proj): rank r holds the matching columns
  of the input dimension; the block that calls it sums the partial outputs over the ranks
  (``TensorParallel.all_reduce``) -- outside the module, so that the wrappers which replace a
  linear (oneDNN packing, int8, batch-invariant padding) keep the sum;
- vocabulary-parallel embedding and LM head: rank r holds vocabulary rows
  ``[r * Vp, (r + 1) * Vp)`` (``Vp = ceil(V / N)``, the last shard padded with zero rows).

KV heads are split when there are at least as many as ranks; otherwise each is replicated on
``N / Hkv`` consecutive ranks (rank r holds KV head ``r * Hkv // N``), as SGLang does.

Each parameter carries a ``weight_loader(param, tensor, shard_id)`` (nano-vllm's): given a
whole checkpoint tensor -- one part of a fused parameter (``shard_id`` "q", "k", "v", or the
index of a merged part), or the whole fused parameter (``shard_id`` None: Phi-3's fused
checkpoints, random weights) -- it copies this rank's rows or columns into place.
``shard_ids`` lists the parts a parameter needs (``models.loader`` checks every one came).
The modules subclass ``torch.nn.Linear``, without its random init: every weight comes from
the checkpoint (or random weights), and torch's reference init on the meta device imports
triton (whose bindings print ~30 "nanobind: leaked" lines at every exit of a CPU scheduler).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.scheduler.layers.parallel import TensorParallel, local_kv_heads, vocab_shard_size


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (casting to dst's dtype, any device to any device) through aten's op:
    the Python method sets a device guard that a CPU-only torch cannot set for (fake) CUDA
    tensors; the same kernel on a GPU."""
    with torch.no_grad():
        torch.ops.aten.copy_.default(dst, src)


def load_whole(param: torch.Tensor, loaded: torch.Tensor, shard_id: object = None) -> None:
    """The loader of a parameter every rank holds whole (norms, routers, biases of row-parallel layers)."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint tensor of shape {list(loaded.shape)} for a parameter of shape "
                         f"{list(param.shape)}")
    copy_into(param.data, loaded)


class ReplicatedLinear(torch.nn.Linear):
    """``y = x W^T + b`` with the whole weight on every rank (a MoE router, a shared expert's gate)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        for p in self.parameters():
            p.requires_grad_(False)
            p.weight_loader = self.weight_loader

    def reset_parameters(self) -> None:
        pass

    def weight_loader(self, param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        load_whole(param, loaded)


class ColumnParallelLinear(ReplicatedLinear):
    """Output rows ``[r * n, (r + 1) * n)`` of rank r (n = out_features / N); weight [n, in], bias [n]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel,
                 dtype: torch.dtype | None = None):
        self.tp = tp
        super().__init__(in_features, out_features // tp.size, bias, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[0]
        copy_into(param.data, loaded.narrow(0, self.tp.rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel linears side by side (gate and up): this rank's rows of part 0, then of part 1, ...

    Args:
        output_sizes: the parts' whole output sizes (each divisible by N).
    """

    def __init__(self, in_features: int, output_sizes: list[int], tp: TensorParallel, dtype: torch.dtype | None = None):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), False, tp, dtype)
        self.weight.shard_ids = frozenset(range(len(output_sizes)))

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:  # every part, concatenated along the output dim
            for i, part in enumerate(loaded.split(self.output_sizes)):
                self.weight_loader(param, part, i)
            return
        n = self.output_sizes[shard_id] // self.tp.size
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        copy_into(param.data.narrow(0, offset, n), loaded.narrow(0, self.tp.rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one: this rank's query heads, then its KV heads' k and v rows.

    Args:
        head_dim: D; num_heads, num_kv_heads: the model's (whole) Hq and Hkv.
        qk_perm: int64 [D] or None, an order of each q and k head's dims applied at load
            (partial rotary: ``layers.rotary.rotary_permutation``).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TensorParallel, dtype: torch.dtype | None = None, qk_perm: torch.Tensor | None = None):
        self.head_dim, self.total_heads, self.total_kv_heads = head_dim, num_heads, num_kv_heads
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = local_kv_heads(num_kv_heads, tp.size)
        self.qk_perm = qk_perm
        self.tp = tp
        ReplicatedLinear.__init__(self, hidden_size, (self.num_heads + 2 * self.num_kv_heads) * head_dim, bias, dtype)
        for p in self.parameters():
            p.shard_ids = frozenset("qkv")

    def weight_loader(self, param, loaded, shard_id=None):
        d, rank, size = self.head_dim, self.tp.rank, self.tp.size
        if shard_id is None:  # the fused [(Hq + 2 Hkv) D, ...] tensor
            parts = loaded.split([self.total_heads * d, self.total_kv_heads * d, self.total_kv_heads * d])
            for sid, part in zip("qkv", parts, strict=True):
                self.weight_loader(param, part, sid)
            return
        if shard_id != "v" and self.qk_perm is not None:
            loaded = loaded.unflatten(0, (-1, d)).index_select(1, self.qk_perm.to(loaded.device)).flatten(0, 1)
        if shard_id == "q":
            rows, start, offset = self.num_heads * d, rank * self.num_heads * d, 0
        else:
            kv = self.total_kv_heads
            first = rank * self.num_kv_heads if kv >= size else rank * kv // size
            rows, start = self.num_kv_heads * d, first * d
            offset = self.num_heads * d + (rows if shard_id == "v" else 0)
        copy_into(param.data.narrow(0, offset, rows), loaded.narrow(0, start, rows))


class RowParallelLinear(ReplicatedLinear):
    """Input columns ``[r * n, (r + 1) * n)`` of rank r (n = in_features / N); weight [out, n], no bias.
    The caller sums the outputs over the ranks (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, dtype: torch.dtype | None = None):
        self.tp = tp
        super().__init__(in_features // tp.size, out_features, False, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[1]
        copy_into(param.data, loaded.narrow(1, self.tp.rank * n, n))


def load_vocab_rows(tp: TensorParallel, param: torch.Tensor, loaded: torch.Tensor) -> None:
    """A [V, hidden] embedding or LM head -> this rank's [Vp, hidden] rows, zero rows past V."""
    v, n = loaded.shape[0], param.shape[0]
    start = tp.rank * n
    mine = max(0, min(n, v - start))
    copy_into(param.data.narrow(0, 0, mine), loaded.narrow(0, min(start, v), mine))
    if mine < n:
        param.data.narrow(0, mine, n - mine).zero_()


class VocabParallelEmbedding(torch.nn.Module):
    """Token embedding over this rank's vocabulary shard; the whole table when size is 1.

    An id outside the shard gives zeros, and an all-reduce sums the one non-zero row.

    Args:
        vocab_size: V of the model (the shard covers rows ``rank * Vp`` to ``rank * Vp + Vp - 1``).
        tp: the group; ``weight`` is [Vp, hidden], filled at load.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel, dtype: torch.dtype | None = None):
        super().__init__()
        self.tp = tp
        self.num_local = vocab_shard_size(vocab_size, tp.size)
        self.start = tp.rank * self.num_local
        self.weight = torch.nn.Parameter(torch.empty(self.num_local, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = lambda param, loaded, shard_id=None: load_vocab_rows(self.tp, param, loaded)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [T] -> [T, hidden] in the weight's dtype (summed over the ranks)."""
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        valid = (local >= 0).logical_and(local < self.num_local)
        out = F.embedding(local.clamp(0, self.num_local - 1), self.weight)
        return self.tp.all_reduce(out.mul_(valid.unsqueeze(-1).to(out.dtype)))


class ParallelLMHead(ReplicatedLinear):
    """The LM head over this rank's vocabulary rows: [T, hidden] -> logits [T, Vp] of the shard
    (``TensorParallel.gather_vocab`` joins the shards). ``tie`` shares the embedding's weight."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel, dtype: torch.dtype | None = None):
        self.tp = tp
        super().__init__(hidden_size, vocab_shard_size(vocab_size, tp.size), False, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        load_vocab_rows(self.tp, param, loaded)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Use ``embedding``'s weight (one tensor for both: tied word embeddings)."""
        self.weight = embedding.weight
