"""Fused mixture-of-experts as a Triton grouped GEMM (GPU): the CUDA path of ``models.blocks.SparseMoeBlock``.

The (token, slot) pairs are laid out in expert blocks of ``BLOCK_M`` rows on the device
(``layers.moe.moe_align_block_size``); one program multiplies one block of rows by one
``BLOCK_N`` slice of its expert's weight, reading the rows' activations through the sorted
pair indices (no gathered copy) and writing each row back at its pair's place. Two
launches per layer: gate_up for every pair, then down with the routing weight applied, and
the K slots of each token are summed. This is the kernel of vLLM's and SGLang's
``fused_moe`` (``fused_moe_kernel``), without quantization and autotuning: fixed block
sizes (``BLOCKS``). No host sync: every shape comes from the step's token count, so a
decode step can be captured in a CUDA graph. Checked against the CPU path under
``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from services.scheduler.layers.moe import moe_align_block_size


def interpreted() -> bool:
    """Whether the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_grouped_gemm_kernel, InterpretedFunction)


# num_pairs (T * K) changes every step and only bounds the row mask: not specialized on (see
# ``kernels.triton_batch_invariant``'s GEMM).
@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr, num_rows_ptr, N, K, num_pairs,
                         stride_am, stride_be, stride_bn, stride_cm,
                         TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, UPCAST: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[pair] = A[pair // TOP_K] @ B[expert]^T (times the pair's weight with MUL_WEIGHT),
    for the BLOCK_M pairs of one expert block and one BLOCK_N slice of N."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)  # [BLOCK_M], num_pairs on padding rows
    valid = pair < num_pairs
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // TOP_K).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + pair, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


# (BLOCK_M, BLOCK_N, BLOCK_K), the same for every step: fixed tiles keep each row's sum
# order independent of the token count (batch invariance, for deterministic inference);
# 16-row blocks suit decode, where few pairs share an expert. A larger BLOCK_M for prefill
# (vLLM's configs) is the tuning left for a GPU.
BLOCKS = (16, 64, 32)


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 num_pairs: int, top_k: int, block: tuple[int, int, int],
                 weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per pair p = t*K + k in the layout: a[p // top_k] @ b[expert(p)]^T, times weights[p] if given.

    Args:
        a: [M, Kdim] contiguous (M = T with top_k = K, or T*K with top_k = 1);
            b: [E, N, Kdim] contiguous; weights: float32 [T*K] or None.
        layout: ``moe_align_block_size``'s (sorted_ids, block_experts, num_rows).

    Returns:
        [num_pairs, N] in a's dtype.
    """
    sorted_ids, block_experts, num_rows = layout
    bm, bn, bk = block
    n, kdim = b.shape[1], b.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (block_experts.numel() * triton.cdiv(n, bn),)
    _grouped_gemm_kernel[grid](
        a, b, out, sorted_ids if weights is None else weights, sorted_ids, block_experts, num_rows, n, kdim, num_pairs,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        TOP_K=top_k, MUL_WEIGHT=weights is not None,
        # The interpreter's tl.dot multiplies 16-bit floats as raw bits (see kernels.triton_attention).
        UPCAST=interpreted() and a.dtype != torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Sum over each token's experts of weight * down(act(gate_up(x))) with the Triton grouped GEMM
    (what ``layers.moe.fused_experts_cpu`` computes on the CPU).

    Args:
        x: [T, H]; w13: [E, 2 I, H]; w2: [E, H, I] (contiguous, model dtype); weights:
            float32 [T, K]; ids: int64 [T, K]; act: SiLU-and-mul.

    Returns:
        [T, H] in x's dtype: the K weighted expert outputs of each token summed in float32.
    """
    t, k = ids.shape
    layout = moe_align_block_size(ids, w13.shape[0], BLOCKS[0])
    h = grouped_gemm(x.contiguous(), w13, layout, t * k, k, BLOCKS)  # [T*K, 2I]
    y = grouped_gemm(act(h).contiguous(), w2, layout, t * k, 1, BLOCKS, weights.reshape(-1).float().contiguous())
    y = y.view(t, k, -1)
    out = y.select(1, 0).float()
    for j in range(1, k):  # slot by slot: the same order for every token count (torch's sum picks by shape)
        out = out + y.select(1, j).float()
    return out.to(x.dtype)
