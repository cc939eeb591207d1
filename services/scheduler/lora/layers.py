"""The LoRA product inside the model: ``LoraLinear`` around a block's linears, one step's rows per adapter.

``attach_lora`` records every decoder layer's qkv_proj, o_proj, gate_up_proj and down_proj
(where the layer has them) at build time; the first adapter placed wraps each in a
``LoraLinear`` (until then the model runs as built). Each step the runner tells the model's
``LoraBatch`` which packed token rows belong to which resident adapter (a slot); the wrapper
runs the base linear on every row, then for each adapter present adds
``(x[rows] @ A^T) @ B^T * scale`` to those rows -- a grouped product per adapter, as
punica's / S-LoRA's segmented kernels compute in one launch (Chen et al. 2023, "Punica";
Sheng et al. 2023, "S-LoRA"). Rows of no adapter (the base model) get the base output only,
and a step without adapter rows costs one Python check per wrapped linear. That torch product
is the CPU path; on CUDA the wrapper keeps the adapters stacked by slot (``stacked``) and
runs the segmented Triton kernel instead (``kernels.triton_lora``: two launches per linear
whatever the number of adapters present).

Fused linears hold their parts' adapters side by side: q, k and v (gate and up) each have
their own A; their A's are stacked [k r, in] and their B's placed block-diagonally in a
[out, k r] matrix, so a fused module's product is two matmuls whatever the parts.

Tensor parallelism: A and B are sharded as the base layer shards its weight, by the base
layer's own ``weight_loader`` (``layers.parallel_linear``) -- column-parallel (qkv, gate/up):
B's rows for this rank's heads or columns, A whole; row-parallel (o, down): A's columns for
this rank's slice of the input, B whole, and the block's all-reduce sums the partial
products with the base output's.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from services.scheduler.layers.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from services.scheduler.lora.adapter import AdapterWeights
from services.scheduler.lora.stacked import SlotStack

# (checkpoint module name, the fused linear's shard id) per wrapped linear, in the fused order.
_PARTS: dict[str, tuple[tuple[str, object], ...]] = {
    "qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
    "o_proj": (("o_proj", None),),
    "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
    "down_proj": (("down_proj", None),),
}


class LoraBatch:
    """The rows of the step running now, per adapter slot (set by ``executor.model_runner``).

    Attributes:
        groups: (slot, int64 [n] packed token rows on the device) per adapter present; empty:
            every row is the base model's.
        rows, segments, max_len: the same for the segmented kernel: all the groups' rows (int64
            [n]), the (slot, start, length) table (int64 [3, g]) on the device, the longest
            group's length.
    """

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor]] = []
        self.rows: torch.Tensor | None = None
        self.segments: torch.Tensor | None = None
        self.max_len = 0

    def set(self, counts: list[tuple[int, int]] | None, rows: torch.Tensor | None) -> None:
        """The step's groups from ``StepBatch.lora`` ((slot, row count) each) and its
        ``lora_rows`` segment (int64 [n + 3 g] on the device: ``registry.step_rows``); None,
        None: no adapter rows. Views of the segment only: no copy, no launch."""
        if counts is None or rows is None:
            self.groups, self.rows, self.segments, self.max_len = [], None, None, 0
            return
        slots, sizes = zip(*counts, strict=True)
        n = sum(sizes)
        self.rows, self.segments, self.max_len = rows.narrow(0, 0, n), rows.narrow(0, n, 3 * len(sizes)).view(
            3, len(sizes)), max(sizes)
        self.groups = list(zip(slots, self.rows.split(list(sizes)), strict=True))


class LoraLinear(torch.nn.Module):
    """A linear of the base model plus the resident adapters' products on their rows.

    Args:
        base: the linear as the model runs it now (the parallel linear, or what packing,
            quantization-free batch-invariance made of it).
        target: the parallel linear it was built as (``LoraTarget``: parts, shard arithmetic).
        batch: the model's ``LoraBatch``.
        stack: the stacked weights (``stacked.SlotStack``) to run the segmented kernel on (the
            CUDA path), or None: each adapter's own (A, B) and the grouped torch product.
    """

    def __init__(self, base: torch.nn.Module, target: LoraTarget, batch: LoraBatch, stack: SlotStack | None = None):
        super().__init__()
        self.base = base
        self.parts = _PARTS[target.name]
        self.row_parallel = target.row_parallel
        self.in_local, self.out_local = target.in_local, target.out_local
        self.batch = batch
        self._load = target.load
        self.adapters: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}  # slot -> (A, B, scale)
        self.stack = stack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in (this rank's)] -> [T, out (this rank's)]: the base output plus each
        present adapter's product on its rows."""
        out = self.base(x)
        if self.stack is not None:
            if self.batch.rows is not None and self.batch.segments is not None:
                self.stack.apply(x, out, self.batch.rows, self.batch.segments, self.batch.max_len)
            return out
        for slot, rows in self.batch.groups:
            weights = self.adapters.get(slot)
            if weights is not None:
                a, b, scale = weights
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t(), alpha=scale)
        return out

    def set_adapter(self, slot: int, layer: int, weights: AdapterWeights, dtype: torch.dtype,
                    device: torch.device) -> None:
        """Hold this rank's shard of ``weights``' A and B for this linear in ``slot`` (nothing
        if the adapter does not adapt any of its parts in ``layer``)."""
        r = weights.rank
        a_parts, b_parts, indices = [], [], []
        for index, (module, shard_id) in enumerate(self.parts):
            pair = weights.tensors.get((layer, module))
            if pair is None:
                continue
            a, b = pair
            if self.row_parallel:
                a_local = torch.empty(r, self.in_local, dtype=dtype, device=device)
                self._load(a_local, a, None)
                a_parts.append(a_local)
                b_parts.append(b.to(device=device, dtype=dtype))
            else:
                b_local = torch.zeros(self.out_local, r, dtype=dtype, device=device)
                self._load(b_local, b, shard_id)
                a_parts.append(a.to(device=device, dtype=dtype))
                b_parts.append(b_local)
            indices.append(index)
        if self.stack is not None:
            self.stack.place(slot, list(zip(indices, a_parts, b_parts, strict=True)), weights.scale)
        elif a_parts:
            self.adapters[slot] = (torch.cat(a_parts).contiguous(), torch.cat(b_parts, dim=1).contiguous(),
                                   weights.scale)

    def drop_adapter(self, slot: int) -> None:
        self.adapters.pop(slot, None)
        if self.stack is not None:
            self.stack.clear(slot)


class LoraTarget:
    """A linear an adapter may adapt, recorded at build time (before packing replaces it).

    Keeps the parallel linear's shard arithmetic (its ``weight_loader`` over its attributes)
    without its weight.
    """

    def __init__(self, layer: int, owner: torch.nn.Module, name: str, base: torch.nn.Linear):
        self.layer, self.owner, self.name = layer, owner, name
        self.row_parallel = isinstance(base, RowParallelLinear)
        self.in_local, self.out_local = base.in_features, base.out_features
        state = SimpleNamespace(**{k: v for k, v in vars(base).items() if not k.startswith("_")})
        loader = type(base).weight_loader
        self.load: Callable[[torch.Tensor, torch.Tensor, object], None] = (
            lambda param, tensor, shard_id: loader(state, param, tensor, shard_id))


class LoraModel:
    """A model's adaptable linears and, once the first adapter is placed, their ``LoraLinear``s.

    The wrappers go in at the first ``add``: until then the model runs exactly as built
    (CUDA graphs captured at start-up replay the base model, which is what they are used for:
    a step with adapter rows runs eagerly).

    Attributes:
        batch: the model's ``LoraBatch``.
        shapes: adaptable module name -> (in, out) features of the whole linear.
        num_layers: decoder layers.

    Args:
        segmented: stack the adapters and run the segmented Triton kernel; None: on a CUDA
            model (the CPU runs the grouped torch product).
    """

    def __init__(self, model: torch.nn.Module, segmented: bool | None = None):
        self.batch = LoraBatch()
        self.targets: list[LoraTarget] = []
        self.linears: list[LoraLinear] = []
        self.shapes: dict[str, tuple[int, int]] = {}
        self.num_layers = len(model.layers)
        self.dtype = model.embed_tokens.weight.dtype
        self.device = model.embed_tokens.weight.device
        self.segmented = self.device.type == "cuda" if segmented is None else segmented
        # The model's layers in one C call bypass the modules: the first adapter's wrappers undo it.
        self._unfuse = getattr(model, "fuse_cpu_linears", None)
        for i, layer in enumerate(model.layers):
            for owner in (getattr(layer, "self_attn", None), getattr(layer, "mlp", None)):
                for name in _PARTS:
                    base = getattr(owner, name, None)
                    if isinstance(base, (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear)):
                        self.targets.append(LoraTarget(i, owner, name, base))
                        if i == 0:
                            self.shapes.update(_whole_shapes(base, name, model.tp.size))

    def add(self, slot: int, weights: AdapterWeights) -> None:
        """Place an adapter (checked against ``shapes`` by ``adapter.read_adapter``) in ``slot``."""
        if not self.linears:
            if self._unfuse is not None:
                self._unfuse(allowed=False)
            for t in self.targets:
                stack = (SlotStack(len(_PARTS[t.name]), t.in_local, t.out_local, self.dtype, self.device)
                         if self.segmented else None)
                wrapper = LoraLinear(getattr(t.owner, t.name), t, self.batch, stack)
                setattr(t.owner, t.name, wrapper)
                self.linears.append(wrapper)
        for t, linear in zip(self.targets, self.linears, strict=True):
            linear.set_adapter(slot, t.layer, weights, self.dtype, self.device)

    def drop(self, slot: int) -> None:
        """Free ``slot``'s tensors."""
        for linear in self.linears:
            linear.drop_adapter(slot)
def _whole_shapes(base: torch.nn.Linear, name: str, tp: int) -> dict[str, tuple[int, int]]:
    """The unsharded (in, out) features of each part of a wrapped linear."""
    if isinstance(base, QKVParallelLinear):
        d = int(base.head_dim)
        return {"q_proj": (base.in_features, base.total_heads * d),
                "k_proj": (base.in_features, base.total_kv_heads * d),
                "v_proj": (base.in_features, base.total_kv_heads * d)}
    if isinstance(base, MergedColumnParallelLinear):
        return {module: (base.in_features, size) for (module, _), size in zip(_PARTS[name], base.output_sizes,
                                                                              strict=True)}
    return {_PARTS[name][0][0]: (base.in_features * tp, base.out_features)}


def attach_lora(model: torch.nn.Module, segmented: bool | None = None) -> LoraModel:
    """Record ``model``'s adaptable linears (``LoraModel``; ``segmented`` as there), once: the
    same one on a second call. Call it before packing or batch-invariance replace the linears."""
    existing = getattr(model, "lora", None)
    if isinstance(existing, LoraModel):
        return existing
    lora = LoraModel(model, segmented)
    model.lora = lora
    return lora
