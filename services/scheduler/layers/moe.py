"""Mixture-of-experts pieces shared by every MoE model: the stacked experts (``Experts``), top-k
routing, the CPU grouped-expert path and the token-to-expert block layout the Triton kernel
(``kernels.triton_moe``) reads.

Expert weights are stacked at load: ``w13`` [E, 2 I, H] (each expert's gate rows, then its
up rows) and ``w2`` [E, H, I]. Under tensor parallelism every rank holds every expert, cut
along the intermediate dim I as a gated MLP is (its gate and up rows, its down columns), and
the MoE block sums the partial outputs over the ranks. A step's tokens are routed to ``top_k`` experts each; the
(token, slot) pairs are sorted by expert so that each expert multiplies one contiguous block
of rows (a grouped matmul), never one token at a time. The layout follows vLLM's and
SGLang's ``fused_moe`` (``moe_align_block_size``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.scheduler.layers.batch_invariant import RowWindow
from services.scheduler.layers.linear import can_pack, pack_weight, packed_linear
from services.scheduler.layers.parallel import TensorParallel
from services.scheduler.layers.parallel_linear import copy_into

ExpertMLP = Callable[[int, torch.Tensor], torch.Tensor]  # (expert, rows [N, H]) -> [N, H]
GATE, UP, DOWN = "gate", "up", "down"


class Experts(torch.nn.Module):
    """Stacked expert weights: ``gate_up`` [E, 2 I/N, H] (this rank's gate rows, then its up
    rows), ``down`` [E, H, I/N].

    Loading (``weight_loader``): a per-expert checkpoint tensor with ``shard_id`` (expert,
    "gate" | "up" | "down"), or the whole stacked [E, 2 I, H] / [E, H, I] tensor (shard_id None).

    On the CPU in bf16, ``pack`` (called by ``layers.linear.pack_linears``) also holds each
    expert's two weights in oneDNN's blocked layout, as ``PackedLinear`` does for dense layers
    (the stacked tensors stay: the Triton path and ``state_dict`` read them). For
    deterministic inference ``layers.batch_invariant`` probes ``linear_shapes`` and sets
    ``window``: an expert's rows run only at the row counts it measured (``RowWindow``), so a
    token's bits do not depend on how many others chose the same expert.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 tp: TensorParallel | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        tp = tp or TensorParallel()
        self.num_experts = num_experts
        self.tp = tp
        inter = intermediate_size // tp.size
        self.gate_up = torch.nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, dtype=dtype),
                                          requires_grad=False)
        self.down = torch.nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=dtype), requires_grad=False)
        for p, parts in ((self.gate_up, (GATE, UP)), (self.down, (DOWN,))):
            p.weight_loader = self.weight_loader
            p.shard_ids = frozenset((e, part) for e in range(num_experts) for part in parts)
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.window: RowWindow | None = None

    def weight_loader(self, param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str] | None) -> None:
        """Copy this rank's rows (gate, up: [I, H]) or columns (down: [H, I]) of a checkpoint tensor."""
        n = self.down.shape[2]
        if shard_id is None:  # the stacked tensor of every expert
            for e in range(self.num_experts):
                one = loaded.select(0, e)
                if param is self.down:
                    self.weight_loader(param, one, (e, DOWN))
                else:
                    self.weight_loader(param, one.narrow(0, 0, one.shape[0] // 2), (e, GATE))
                    self.weight_loader(param, one.narrow(0, one.shape[0] // 2, one.shape[0] // 2), (e, UP))
            return
        e, part = shard_id
        if part == DOWN:
            copy_into(param.data.select(0, e), loaded.narrow(1, self.tp.rank * n, n))
        else:
            copy_into(param.data.select(0, e).narrow(0, 0 if part == GATE else n, n),
                      loaded.narrow(0, self.tp.rank * n, n))

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in_features, out_features) of each expert's two matmuls: gate_up, then down."""
        e, two_i, h = self.gate_up.shape
        return [(h, two_i), (two_i // 2, h)]

    def pack(self) -> int:
        """Pack every expert's weights for oneDNN if ``layers.linear.can_pack`` allows; returns how many."""
        if self.packed is not None or not can_pack(self.gate_up):
            return 0
        self.packed = [(pack_weight(self.gate_up.select(0, e)), pack_weight(self.down.select(0, e)))
                       for e in range(self.num_experts)]
        return 2 * self.num_experts

    def mlp(self, act) -> ExpertMLP:
        """(e, rows [N, H]) -> down_e(act(gate_up_e(rows))) [N, H], on the packed weights when packed."""
        if self.packed is None:
            run = stacked_expert(self.gate_up, self.down, act)
        else:
            packed = self.packed

            def run(e: int, rows: torch.Tensor) -> torch.Tensor:
                return packed_linear(act(packed_linear(rows, packed[e][0])), packed[e][1])
        window = self.window
        if window is None:
            return run
        return lambda e, rows: window.apply(lambda part: run(e, part), rows)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (in float32), then the top ``top_k``; with ``renormalize`` the
    chosen probabilities are divided by their sum (Mixtral always; Qwen-MoE when the config
    sets ``norm_topk_prob``), as transformers' routers do.

    Args:
        router_logits: [T, E] in the model dtype.

    Returns:
        (weights float32 [T, K], expert ids int64 [T, K]).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def stacked_expert(w13: torch.Tensor, w2: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> ExpertMLP:
    """The ``expert_mlp`` of ``fused_experts_cpu`` for stacked weights w13 [E, 2 I, H], w2 [E, H, I]:
    down(act(gate_up(rows))) with expert e's slices."""
    return lambda e, rows: F.linear(act(F.linear(rows, w13.select(0, e))), w2.select(0, e))


def fused_experts_cpu(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int,
                      expert_mlp: ExpertMLP) -> torch.Tensor:
    """Sum over each token's experts of weight * expert_mlp(e, x), on the CPU.

    The (token, slot) pairs are sorted by expert (stable), gathered once, and each expert
    that has tokens runs on its contiguous rows: a loop over at most E experts, never over
    tokens. Products are summed back per token in float32.

    Args:
        x: [T, H]; weights: float32 [T, K]; ids: int64 [T, K]; expert_mlp: (e, rows [N, H])
            -> [N, H], e.g. ``stacked_expert`` or ``Experts``' oneDNN-packed one.

    Returns:
        [T, H] in x's dtype.
    """
    t, k = ids.shape
    flat = ids.view(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # host ints: this is the CPU path
    rows = x.index_select(0, order // k)  # [T*K, H], expert-major
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            outs.append(expert_mlp(e, rows.narrow(0, start, n)))
            start += n
    y = torch.cat(outs).float() * weights.view(-1).index_select(0, order).unsqueeze(1)
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, order // k, y).to(x.dtype)


def moe_align_block_size(ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay the (token, slot) pairs out in expert blocks of ``block_m`` rows, on the device.

    Each expert's pairs are padded to a multiple of ``block_m``; pads hold the sentinel
    T*K. Device ops only, every shape from ``ids.shape``: no host sync (CUDA graphs, fake
    tensors).

    Args:
        ids: int64 [T, K], each token's experts.

    Returns:
        sorted_ids: int32 [P], flat pair index t*K + k per row, expert-major, P =
            T*K + min(E, T*K) * (block_m - 1) rounded up to ``block_m`` (the most padding needs);
        block_experts: int32 [P / block_m], the expert of each block;
        num_rows: int32 [1], rows in use (blocks at or past it are idle).
    """
    flat = ids.view(-1)
    tk = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat.index_select(0, order)
    rank = torch.arange(tk, device=dev) - (torch.cumsum(counts, 0) - counts).index_select(0, expert_of)
    dest = (pad_end - padded).index_select(0, expert_of) + rank
    size = -(-(tk + min(num_experts, tk) * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((size,), tk, dtype=torch.int32, device=dev).scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, size, block_m, device=dev)
    block_experts = torch.searchsorted(pad_end, starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_experts, pad_end.narrow(0, num_experts - 1, 1).to(torch.int32)
