"""Time the Triton attention backend against the torch one, side by side, on a CUDA GPU.

For each shape, both backends run one layer's ``forward`` (write the step's K/V into the
paged pool, then attend) on the same bf16 pool, with K/V rows scattered over it as a busy
server leaves them; per-step preparation (``init_forward_metadata``, the torch masks) is
built once outside the timed region, as the model does once for all layers. Times are
``triton.testing.do_bench`` medians (ms, CUDA events, warm-up first, L2 flushed per rep).
Prints one row per shape with both times, torch/triton (> 1: Triton faster) and the
largest output difference.

Usage (on a GPU machine, from the repo root):
    .venv/bin/python bench/attention_kernels.py [--json bench/results/attention_kernels.json]

Refuses to run without CUDA, and under TRITON_INTERPRET=1 (that would time the interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from services.scheduler.attention.backends import create_attention_backend
from services.scheduler.attention.paged import AttnMetadata, DecodeLayout, ExtendLayout
from services.scheduler.executor.device import create_runtime


@dataclass(frozen=True)
class Shape:
    """One step of one layer: query/KV heads, head_dim, and per request (cached prefix, new tokens)."""

    name: str
    hq: int
    hkv: int
    d: int
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]


def _shapes() -> list[Shape]:
    llama8b, smol = (32, 8, 128), (9, 3, 64)  # Llama-3-8B; SmolLM2-135M (what ringserve ships)
    out = []
    for heads, tag in ((llama8b, "llama3-8b"), (smol, "smollm2")):
        for batch, ctx in ((1, 1024), (16, 1024), (64, 1024), (16, 4096), (64, 4096)):
            out.append(Shape(f"{tag} decode B={batch} ctx={ctx}", *heads, (ctx - 1,) * batch, (1,) * batch))
        out.append(Shape(f"{tag} prefill 1x2048", *heads, (0,), (2048,)))
        out.append(Shape(f"{tag} prefill 8x512", *heads, (0,) * 8, (512,) * 8))
        out.append(Shape(f"{tag} extend 4x512 on 2048 cached", *heads, (2048,) * 4, (512,) * 4))
    return out


def _metadata(shape: Shape, dev: torch.device, pool_size: int, gen: torch.Generator) -> tuple[AttnMetadata, int]:
    """Both backends' layouts for ``shape`` (all rows extend, or all decode), pool rows drawn at random."""
    prefix = torch.tensor(shape.prefix_lens)
    ext = torch.tensor(shape.extend_lens)
    seq = prefix + ext
    width = int(seq.max())
    rows = torch.randperm(pool_size, generator=gen)[: int(seq.sum())]
    kv_indices = torch.zeros(len(seq), width, dtype=torch.int64)
    new_rows, start = [], 0
    for b, n in enumerate(seq.tolist()):
        kv_indices[b, :n] = rows[start : start + n]
        new_rows.append(kv_indices[b, n - int(ext[b]) : n])
        start += n
    t = int(ext.sum())
    meta = AttnMetadata(torch.cat(new_rows).to(dev))
    keys = torch.arange(width)
    if int(ext.max()) == 1:
        valid = keys[None, :] < seq[:, None]
        mask = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))[:, None, None, :]
        meta.decode = DecodeLayout(kv_indices.to(dev), seq.to(dev), mask.to(dev))
        return meta, t
    lq = int(ext.max())
    i = torch.arange(lq)[None, :]
    offset = torch.minimum(i, ext[:, None] - 1)
    q_pos = prefix[:, None] + offset  # [B, Lq]
    q_valid = ((torch.arange(len(seq)) * lq)[:, None] + i)[i < ext[:, None]]
    mask = None  # one fresh prompt: plain causal SDPA, as the model runner does
    if len(seq) > 1 or int(prefix[0]) > 0:
        mask = (keys[None, None, :] <= q_pos[:, :, None])[:, None].to(dev)  # [B, 1, Lq, L]
    meta.extend = ExtendLayout(kv_indices.to(dev), prefix.to(dev), ext.to(dev),
                               ((torch.cumsum(ext, 0) - ext)[:, None] + offset).to(dev), q_valid.to(dev), mask)
    meta.num_extend_tokens = t
    return meta, t


def run(shapes: list[Shape], dtype: torch.dtype, dev: torch.device) -> list[dict]:
    """Time both backends per shape on ``dev``; returns one dict per shape (ms, ratio, max |diff|)."""
    from triton.testing import do_bench

    gen = torch.Generator().manual_seed(0)
    backends = {name: create_attention_backend(name, create_runtime(dev)) for name in ("torch", "triton")}
    rows = []
    for shape in shapes:
        pool_size = 2 * sum(p + e for p, e in zip(shape.prefix_lens, shape.extend_lens, strict=True))
        pool = SimpleNamespace(k_buffer=[torch.randn(pool_size, shape.hkv, shape.d, device=dev).to(dtype)],
                               v_buffer=[torch.randn(pool_size, shape.hkv, shape.d, device=dev).to(dtype)])
        meta, t = _metadata(shape, dev, pool_size, gen)
        q = torch.randn(t, shape.hq, shape.d, device=dev).to(dtype)
        k = torch.randn(t, shape.hkv, shape.d, device=dev).to(dtype)
        v = torch.randn(t, shape.hkv, shape.d, device=dev).to(dtype)
        scale = shape.d**-0.5
        row = {"shape": shape.name}
        outs = {}
        for name, backend in backends.items():
            backend.init_forward_metadata(meta)
            outs[name] = backend.forward(q, k, v, 0, meta, pool, scale).float()
            # Timed here, in the iteration that made q, k, v, meta and pool.
            row[f"{name}_ms"] = do_bench(lambda b=backend: b.forward(q, k, v, 0, meta, pool, scale))  # noqa: B023
            torch.cuda.empty_cache()
        row["torch_over_triton"] = row["torch_ms"] / row["triton_ms"]
        row["max_abs_diff"] = (outs["torch"] - outs["triton"]).abs().max().item()
        rows.append(row)
        print(f"{row['shape']:<44} torch {row['torch_ms']:9.3f} ms  triton {row['triton_ms']:9.3f} ms  "
              f"torch/triton {row['torch_over_triton']:6.2f}x  max|diff| {row['max_abs_diff']:.2e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="KV pool and q/k/v dtype")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("attention_kernels: TRITON_INTERPRET=1 would time Triton's interpreter; unset it")
    if not torch.cuda.is_available():
        sys.exit("attention_kernels: no CUDA device (torch.cuda.is_available() is False); "
                 "these are GPU kernel timings, run this on a machine with an NVIDIA GPU")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {a.dtype}", flush=True)
    rows = run(_shapes(), getattr(torch, a.dtype), torch.device("cuda"))
    if a.json is not None:
        report = {"device": torch.cuda.get_device_name(), "dtype": a.dtype, "rows": rows}
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
