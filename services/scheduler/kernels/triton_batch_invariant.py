"""Batch-invariant GEMM and RMSNorm as Triton kernels: deterministic inference on CUDA.

cuBLAS picks its kernel, tile and split-K by the problem's shape, so a token's row of
``x @ W^T`` can change bits with the number of rows beside it. This kernel fixes the tile
(``BLOCK_M`` x ``BLOCK_N``, ``BLOCK_K`` deep) for every M and never splits K: each output
element is the same sequence of ``tl.dot`` block products over K, accumulated in fp32 in
the same order, whichever rows share its tile (the batch-invariant matmul of He et al.,
"Defeating Nondeterminism in LLM Inference", Thinking Machines 2025, without their
persistent scheduling). Checked under ``TRITON_INTERPRET=1`` on CPU tensors against
``torch.nn.functional.linear``; its speed against cuBLAS on a GPU is the GPU check's to
measure (bench/gpu_check.py).

torch's CUDA reductions (``rms_norm``) likewise split a row over more threads when there
are few rows; ``batch_invariant_rms_norm`` reduces each row in one program, in one order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.scheduler.layers.norm import RMSNorm

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64


# M, the step's token count, is not specialized on: the JIT would otherwise compile a kernel for
# M == 1 and for M % 16 == 0 beside the general one (the first time each occurs, mid-serving),
# and M only bounds the row masks.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(X, W, B, OUT, M, N, K, stride_xm, stride_wn, stride_om,
                   HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(X + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(W + rn[None, :] * stride_wn + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, w)  # [BLOCK_M, BLOCK_N], K blocks always in the same order
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rm[:, None] * stride_om + rn[None, :], acc.to(OUT.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_matmul_kernel, InterpretedFunction)


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias`` with every row computed the same way for any row count.

    Args:
        x: [M, K]; weight: [N, K]; bias: [N] or None; one dtype and device (CUDA, or CPU
            under Triton's interpreter).

    Returns:
        [M, N] in x's dtype (fp32 accumulation, one rounding).
    """
    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    weight = weight.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    interpreted = _interpreted()  # the interpreter's tl.dot cannot multiply 16-bit floats
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](x, weight, bias if bias is not None else weight, out, m, n, k,
                         x.stride(0), weight.stride(0), out.stride(0),
                         HAS_BIAS=bias is not None, UPCAST=interpreted and x.dtype != torch.float32,
                         BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


class TritonLinear(torch.nn.Module):
    """A linear layer through ``batch_invariant_linear``; takes over ``linear``'s weight and bias."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] -> [T, out_features]."""
        return batch_invariant_linear(x, self.weight, self.bias)


@triton.jit
def _rms_norm_kernel(X, W, OUT, H, stride_x, stride_o, eps, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    x = tl.load(X + row * stride_x + h, mask=h < H, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / H + eps)
    # Rounded to the model dtype, then scaled, as RMSNorm (the product of two model-dtype
    # values, formed in fp32 and rounded once).
    normed = (x * inv).to(OUT.dtype.element_ty).to(tl.float32)
    w = tl.load(W + h, mask=h < H, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + h, (w * normed).to(OUT.dtype.element_ty), mask=h < H)


def batch_invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``layers.norm.RMSNorm`` with one program per row: x [..., H] -> the same shape in x's
    dtype (leading dims flattened into rows: Qwen3's q/k norms pass [T, heads, head_dim])."""
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden).contiguous()
    out = torch.empty_like(rows)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, hidden, rows.stride(0), out.stride(0), eps,
                                       BLOCK_H=triton.next_power_of_2(hidden))
    return out.view(x.shape)


class TritonRMSNorm(RMSNorm):
    """``RMSNorm`` through ``batch_invariant_rms_norm`` (same weight and eps)."""

    @classmethod
    def of(cls, norm: RMSNorm) -> TritonRMSNorm:
        """A ``TritonRMSNorm`` sharing ``norm``'s weight."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.weight, new.eps, new.fused = norm.weight, norm.eps, None
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return batch_invariant_rms_norm(x, self.weight, self.eps)
