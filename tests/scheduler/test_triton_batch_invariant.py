"""The Triton GEMM and RMSNorm of deterministic inference on CUDA, under Triton's interpreter on
CPU tensors: the results of ``torch.nn.functional.linear`` and ``RMSNorm`` (to rounding), and
each row's bits the same at any row count and offset. TRITON_INTERPRET must be set before
triton is imported, hence the subprocess."""

from __future__ import annotations

from tests.helpers.triton_interpreter import run_interpreted

CHECK = r"""
import json, numpy as np, torch

# The interpreter runs tl.dot as numpy.matmul, and OpenBLAS's AVX2 (Haswell) sgemm gives a row
# different bits at different positions in its tile (measured: 672 of 1024 row moves in a
# 32x64 @ 64x64 product), which no GPU MMA does. A float64 product rounded once to fp32 is the
# same for a row wherever it sits, so row invariance here tests the kernel, not numpy's BLAS.
_matmul = np.matmul
def _row_exact_matmul(a, b, dtype=None):
    out = _matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
    return out.astype(dtype if dtype is not None else np.result_type(a, b))
np.matmul = _row_exact_matmul
from services.scheduler.kernels.triton_batch_invariant import (TritonLinear, TritonRMSNorm, batch_invariant_linear,
                                                               batch_invariant_rms_norm)
from services.scheduler.layers.batch_invariant import _use_triton
from services.scheduler.layers.norm import RMSNorm

torch.manual_seed(0)
out = {}
for dtype in (torch.float32, torch.bfloat16):
    x, w, b = torch.randn(70, 96).to(dtype), torch.randn(130, 96).to(dtype), torch.randn(130).to(dtype)
    full = batch_invariant_linear(x, w, b)
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float())
    rows = all(torch.equal(batch_invariant_linear(x[i:i + m], w, b), full[i:i + m])
               for i, m in [(0, 1), (5, 3), (33, 37)])
    norm = RMSNorm(96, 1e-5)
    norm.weight = torch.nn.Parameter(torch.rand(96).to(dtype), requires_grad=False)
    got = batch_invariant_rms_norm(x, norm.weight, 1e-5)
    norm_rows = all(torch.equal(batch_invariant_rms_norm(x[i:i + 1], norm.weight, 1e-5), got[i:i + 1])
                    for i in (0, 3, 69))
    rel = (full.float() - ref).abs().max().item() / ref.abs().max().item()
    norm_err = (got.float() - norm(x).float()).abs().max().item()
    out[str(dtype)] = [list(full.shape), str(full.dtype), rel, rows, norm_err, norm_rows]
# Qwen3's q/k norms hand the norm [T, heads, head_dim]: each head a row.
heads = torch.randn(5, 3, 32).to(torch.bfloat16)
qk_norm = RMSNorm(32, 1e-6)
qk_norm.weight = torch.nn.Parameter(torch.rand(32).to(torch.bfloat16), requires_grad=False)
got = TritonRMSNorm.of(qk_norm)(heads)
out["heads"] = [list(got.shape), (got.float() - qk_norm(heads).float()).abs().max().item(),
                torch.equal(got[2:3], TritonRMSNorm.of(qk_norm)(heads[2:3]))]
model = torch.nn.Sequential(torch.nn.Linear(96, 64), RMSNorm(64, 1e-6))
swapped = _use_triton(model)
out["swapped"] = [sorted(swapped), type(model[0]).__name__, type(model[1]).__name__, model[0].weight is not None]
print(json.dumps(out))
"""


def test_triton_gemm_and_rms_norm_are_batch_invariant():
    got = run_interpreted(CHECK)
    shape, norm_err, row_equal = got["heads"]  # [T, heads, head_dim] in bf16: one rounding
    assert shape == [5, 3, 32] and norm_err <= 2**-5 and row_equal
    shape, dtype, rel_err, rows_equal, norm_err, norm_rows_equal = got["torch.float32"]
    assert shape == [70, 130] and dtype == "torch.float32" and rel_err < 1e-6 and norm_err < 1e-6
    assert rows_equal and norm_rows_equal
    shape, dtype, rel_err, rows_equal, norm_err, norm_rows_equal = got["torch.bfloat16"]
    # One bf16 rounding of the output (the interpreter's conversion may round either way: 1 ulp).
    assert shape == [70, 130] and dtype == "torch.bfloat16" and rel_err < 2**-7 and norm_err <= 2**-5
    assert rows_equal and norm_rows_equal
    assert got["swapped"] == [["0", "1"], "TritonLinear", "TritonRMSNorm", True]
