"""Mixture-of-experts pieces shared by every MoE model: top-k routing, the CPU grouped-expert
path and the token-to-expert block layout the Triton kernel (``layers.triton_moe``) reads.

Expert weights are stacked at load: ``w13`` [E, 2 I, H] (each expert's gate rows, then its
up rows) and ``w2`` [E, H, I]. A step's tokens are routed to ``top_k`` experts each; the
(token, slot) pairs are sorted by expert so that each expert multiplies one contiguous block
of rows (a grouped matmul), never one token at a time. The layout follows vLLM's and
SGLang's ``fused_moe`` (``moe_align_block_size``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ExpertMLP = Callable[[int, torch.Tensor], torch.Tensor]  # (expert, rows [N, H]) -> [N, H]


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
            -> [N, H], e.g. ``stacked_expert`` or ``models.moe.Experts``' oneDNN-packed one.

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
