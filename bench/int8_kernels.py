"""int8 linears: ringserve's C kernels against oneDNN through torch, side by side.

For each SmolLM2-135M weight shape (qkv, o, gate/up, down, LM head) and row count, the
median time of:

- ``bf16``: oneDNN's bf16 GEMM on pre-packed weights (``layers.linear``), the default path;
- ``torch-w8a8``: per-token activation quantization (ours) + ``torch._int_mm`` (oneDNN's
  s8 x s8 -> s32 GEMM) + the dequantizing epilogue in torch;
- ``torch-w8``: ``torch.ops.aten._weight_int8pack_mm``, torch's weight-only int8 (bf16
  activations, per-channel scales);
- ours: ``w8a8`` (VNNI, exact int32), ``w8`` and ``w8bf16`` (weight-only), ``layers.quant``.

Prints milliseconds and each kernel's ratio to bf16 (>1: faster).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/int8_kernels.py [--threads 2] [--rows 1 4 16 64]

(On a machine other processes keep busy, spinning OpenMP workers turn every timing into a
wait for a core: use PASSIVE there, or --threads 1.)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from services.scheduler.layers.linear import pack_weight, packed_linear
from services.scheduler.layers.quant import Int8Linear

SHAPES = {"qkv_proj": (960, 576), "o_proj": (576, 576), "gate_up_proj": (3072, 576), "down_proj": (576, 1536),
          "lm_head": (49152, 576)}


def median_ms(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def torch_w8a8(x: torch.Tensor, wq_t: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """Per-token symmetric int8 activations, oneDNN's int8 GEMM, fp32 dequantization."""
    xf = x.float()
    xs = xf.abs().amax(dim=1, keepdim=True) / 127
    xq = torch.round(xf / xs).to(torch.int8)
    return (torch._int_mm(xq, wq_t).float() * xs * w_scale).to(x.dtype)


def kernel_calls(x: torch.Tensor, packed_bf16: torch.Tensor, ours: Int8Linear, wq: torch.Tensor,
                 wq_t: torch.Tensor, w_scale: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """Each kernel's call on ``x`` [rows, k] bf16, by name (the weights prepared beforehand)."""
    return {"bf16": lambda: packed_linear(x, packed_bf16),
            "torch-w8a8": lambda: torch_w8a8(x, wq_t, w_scale),
            "torch-w8": lambda: torch.ops.aten._weight_int8pack_mm(x, wq, w_scale.bfloat16()),
            "w8a8": lambda: ours(x, "w8a8"), "w8": lambda: ours(x, "w8"), "w8bf16": lambda: ours(x, "w8bf16")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--repeats", type=int, default=50)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    kernels = ["bf16", "torch-w8a8", "torch-w8", "w8a8", "w8", "w8bf16"]
    print(f"threads={a.threads}; ms (ratio to bf16)")
    print("| shape | rows | " + " | ".join(kernels) + " |")
    print("|---|---|" + "---|" * len(kernels))
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g) * 0.02
        packed_bf16 = pack_weight(w.bfloat16())
        ours = Int8Linear(w, None)
        w_scale = w.abs().amax(dim=1) / 127
        wq = torch.round(w / w_scale[:, None]).to(torch.int8)
        wq_t = wq.t()
        repeats = max(5, a.repeats // 10) if n > 10_000 else a.repeats
        for rows in a.rows:
            x = torch.randn(rows, k, generator=g).bfloat16()
            fns = kernel_calls(x, packed_bf16, ours, wq, wq_t, w_scale)
            ms = {kname: median_ms(fn, repeats) for kname, fn in fns.items()}
            cells = [f"{ms[kn]:.3f} ({ms['bf16'] / ms[kn]:.2f}x)" for kn in kernels]
            print(f"| {name} {n}x{k} | {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
