"""Time the cpu backend's C kernels against the torch ops they replace, side by side, on CPU.

Each row runs both sides on the same inputs in one process, alternating, and prints the
median of each (ms per call, ``time.perf_counter``), torch/C (> 1: the C kernel is
faster) and whether the outputs agree. Shapes are SmolLM2-135M's (9 query heads, 3 KV
heads, head_dim 64, hidden 576, intermediate 1536) at decode batch 1 and 64, with the
K/V rows of each request scattered over a 20,000-row bf16 pool as a busy server leaves
them.

Usage (from the repo root): ``.venv/bin/python bench/cpu_kernels.py [--threads 1] [--context 192]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from services.scheduler.attention.paged import _decode
from services.scheduler.kernels import cpu_kernels
from services.scheduler.layers.rotary import apply_rotary_packed

HQ, HKV, D, HIDDEN, INTER, POOL = 9, 3, 64, 576, 1536, 20000


def _median_ms(fn: Callable[[], object], other: Callable[[], object], reps: int) -> tuple[float, float]:
    """Medians (ms) of fn and other, called alternately after a warm-up of each."""
    fn(), other()
    a, b = [], []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        a.append(time.perf_counter() - t)
        t = time.perf_counter()
        other()
        b.append(time.perf_counter() - t)
    return statistics.median(a) * 1e3, statistics.median(b) * 1e3


def rows(batch: int, context: int, reps: int) -> list[tuple[str, float, float, str]]:
    """(kernel, torch ms, C ms, agreement) for one decode batch size."""
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    q = torch.randn(batch, HQ, D, generator=gen).to(bf)
    k_buf = torch.randn(POOL, HKV, D, generator=gen).to(bf)
    v_buf = torch.randn(POOL, HKV, D, generator=gen).to(bf)
    kv_indices = torch.stack([torch.randperm(POOL, generator=gen)[:context] for _ in range(batch)])
    seq_lens = torch.full((batch,), context, dtype=torch.int64)
    out = []

    t_ms, c_ms = _median_ms(lambda: _decode(q, k_buf, v_buf, kv_indices, None, D**-0.5),
                            lambda: cpu_kernels.decode_attention(q, k_buf, v_buf, kv_indices, seq_lens, D**-0.5), reps)
    diff = (_decode(q, k_buf, v_buf, kv_indices, None, D**-0.5).view(batch, HQ, D).float()
            - cpu_kernels.decode_attention(q, k_buf, v_buf, kv_indices, seq_lens, D**-0.5).float())
    out.append(("decode attention", t_ms, c_ms, f"max diff {diff.abs().max().item():.3g}"))

    qkv = torch.randn(batch, (HQ + 2 * HKV) * D, generator=gen).to(bf)
    angles = torch.rand(batch, 1, D, generator=gen) * 6.3
    cos, sin = angles.cos().to(bf), angles.sin().to(bf)
    loc = torch.randperm(POOL, generator=gen)[:batch]

    def torch_rotary():
        qk, v = qkv.split([(HQ + HKV) * D, HKV * D], dim=-1)
        r = apply_rotary_packed(qk.view(batch, HQ + HKV, D), cos, sin)
        k_buf.index_copy_(0, loc, r[:, HQ:])
        v_buf.index_copy_(0, loc, v.view(batch, HKV, D))
        return r[:, :HQ]

    t_ms, c_ms = _median_ms(torch_rotary, lambda: cpu_kernels.rotary_store(qkv, cos, sin, loc, k_buf, v_buf, HQ), reps)
    same = torch.equal(torch_rotary(), cpu_kernels.rotary_store(qkv, cos, sin, loc, k_buf, v_buf, HQ))
    out.append(("rotary + K/V store", t_ms, c_ms, "bit-identical" if same else "DIFFERENT"))

    x = torch.randn(batch, HIDDEN, generator=gen).to(bf)
    residual = torch.randn(batch, HIDDEN, generator=gen).to(bf)
    weight = torch.randn(HIDDEN, generator=gen).to(bf)

    def torch_norm():
        h = residual + x
        return weight * F.rms_norm(h.float(), (HIDDEN,), eps=1e-5).to(bf)

    spare = residual.clone()
    t_ms, c_ms = _median_ms(torch_norm, lambda: cpu_kernels.add_rms_norm(x, weight, 1e-5, spare.copy_(residual)), reps)
    same = torch.equal(torch_norm(), cpu_kernels.add_rms_norm(x, weight, 1e-5, spare.copy_(residual)))
    out.append(("residual add + RMSNorm", t_ms, c_ms, "bit-identical" if same else "DIFFERENT"))

    gate_up = torch.randn(batch, 2 * INTER, generator=gen).to(bf)

    def torch_silu():
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    t_ms, c_ms = _median_ms(torch_silu, lambda: cpu_kernels.silu_and_mul(gate_up), reps)
    same = torch.equal(torch_silu(), cpu_kernels.silu_and_mul(gate_up))
    out.append(("SiLU and mul", t_ms, c_ms, "bit-identical" if same else "DIFFERENT"))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=192, help="keys per request")
    p.add_argument("--reps", type=int, default=50)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cpu_kernels.library()
    print(f"bf16, {a.threads} thread(s), {a.context} keys per request; ms per call (median of {a.reps})\n")
    print("| batch | kernel | torch ms | C ms | torch/C | outputs |")
    print("|---|---|---|---|---|---|")
    for batch in (1, 64):
        for name, t_ms, c_ms, agree in rows(batch, a.context, a.reps):
            print(f"| {batch} | {name} | {t_ms:.3f} | {c_ms:.3f} | {t_ms / c_ms:.2f}x | {agree} |")


if __name__ == "__main__":
    main()
