"""Segmented LoRA products as a Triton kernel (GPU): the CUDA path of ``lora.layers.LoraLinear``.

A step's adapter rows come grouped by adapter slot (``lora.registry.step_rows``): the
packed token rows of each segment and a table of (slot, start, length) per segment. One
kernel, launched twice per wrapped linear, multiplies every segment by its own slot's
weight, which it reads from a stack of all resident adapters' weights ([slots, N, K],
``lora.stacked``) by slot id:

- shrink: ``t[j] = x[rows[j]] @ A[slot]^T`` (in -> the padded rank), gathering the rows;
- expand: ``out[rows[j]] += scale[slot] * t[j] @ B[slot]^T`` (rank -> out), scattering back.

This is the SGMV ("segmented gather matrix-vector") kernel of Punica (Chen et al. 2023) and
S-LoRA (Sheng et al. 2023), written as vLLM's ``lora_shrink`` / ``lora_expand`` lay it out:
the grid's second axis is the segment, the first the row blocks of the longest segment
times the N slices; a program past its segment's end returns at once. Rows of the base
model are in no segment and never read; a slot whose scale is 0 (the adapter leaves this
linear alone) returns at once too. No host sync: every argument is a device tensor or a
size the host knows (the longest segment), so the launch never waits for the GPU. Fixed
tiles (``BLOCKS``); the products run through ``tl.dot`` (TF32 on GPUs for float32 weights,
as in the other kernels here), accumulated in float32. Checked against the grouped torch
product under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreted() -> bool:
    """Whether the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_sgmv_kernel, InterpretedFunction)


# The segment count and the sizes change from step to step and only bound masks and loops:
# not specialized on, so one compiled kernel serves every step.
@triton.jit(do_not_specialize=["num_segments", "N", "K"])
def _sgmv_kernel(in_ptr, w_ptr, out_ptr, scale_ptr, rows_ptr, seg_ptr, num_segments, N, K,
                 stride_in, stride_ws, stride_wn, stride_out,
                 EXPAND: tl.constexpr, UPCAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One BLOCK_M x BLOCK_N tile of one segment: shrink (EXPAND False) or expand (module docstring)."""
    pid = tl.program_id(0)
    seg = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    slot = tl.load(seg_ptr + seg)
    start = tl.load(seg_ptr + num_segments + seg)
    length = tl.load(seg_ptr + 2 * num_segments + seg)
    scale = tl.load(scale_ptr + slot)
    if pid_m * BLOCK_M >= length or scale == 0.0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = offs_m < length
    position = start + offs_m  # the rows' places in the segment-sorted order
    row = tl.load(rows_ptr + position, mask=valid, other=0)  # their packed token rows
    in_row = position if EXPAND else row
    out_row = row if EXPAND else position
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    in_ptrs = in_ptr + in_row.to(tl.int64)[:, None] * stride_in + offs_k[None, :]
    w_ptrs = w_ptr + slot.to(tl.int64) * stride_ws + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k0 * BLOCK_K
        a = tl.load(in_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, w)
        in_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + out_row.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    mask = valid[:, None] & (offs_n[None, :] < N)
    if EXPAND:  # each row is in one segment only: no other program writes it
        # The product rounds to the model dtype before the add, as ``out.index_add_(..., alpha)`` does.
        prod = (acc * scale).to(out_ptr.dtype.element_ty)
        acc = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + prod.to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# (BLOCK_M, BLOCK_N, BLOCK_K), the same for every step and both launches (tl.dot's tiles are
# at least 16 on a side); a padded rank of 8 or 16 fills part of one N tile of the shrink.
BLOCKS = (16, 64, 32)


def _launch(inp: torch.Tensor, w: torch.Tensor, out: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor,
            segments: torch.Tensor, max_len: int, expand: bool) -> None:
    bm, bn, bk = BLOCKS
    n, k = w.shape[1], w.shape[2]
    g = segments.shape[1]
    grid = (triton.cdiv(max_len, bm) * triton.cdiv(n, bn), g)
    _sgmv_kernel[grid](inp, w, out, scales, rows, segments, g, n, k,
                       inp.stride(0), w.stride(0), w.stride(1), out.stride(0),
                       # The interpreter's tl.dot multiplies 16-bit floats as raw bits (see kernels.triton_attention).
                       EXPAND=expand, UPCAST=interpreted() and inp.dtype != torch.float32,
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)


def sgmv(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
         rows: torch.Tensor, segments: torch.Tensor, max_len: int) -> torch.Tensor:
    """Add each segment's LoRA product to its rows of ``out``, in place:
    ``out[rows_s] += scales[slot_s] * (x[rows_s] @ a[slot_s]^T) @ b[slot_s]^T``.

    Args:
        x: [T, in] contiguous rows; out: [T, out] contiguous, the base output (changed in place).
        a: [slots, R, in]; b: [slots, out, R] (contiguous, x's dtype; R the padded rank,
            zero beyond each adapter's own); scales: float32 [slots], 0 for a slot that does
            not adapt this linear (its segments are skipped).
        rows: int64 [n] packed token rows, grouped by segment; segments: int64 [3, g]: each
            segment's slot, start in ``rows`` and length.
        max_len: the longest segment's length (a host int: the grid's row blocks).

    Returns:
        ``out``. The rank-R intermediate is rounded to x's dtype, as the torch product is.
    """
    if max_len == 0:
        return out
    t = torch.empty(rows.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    _launch(x, a, t, scales, rows, segments, max_len, expand=False)
    _launch(t, b, out, scales, rows, segments, max_len, expand=True)
    return out
