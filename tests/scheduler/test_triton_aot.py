"""Every Triton kernel ringserve ships, compiled ahead of time for sm_80 and sm_90 on this CPU-only
machine (``bench/triton_aot.py``, ``services.scheduler.triton_aot``): each specialization the
CUDA path launches at the shapes of SmolLM2-135M, Llama-3-8B, Qwen2.5-7B, Gemma-3-270M and
Qwen3-30B-A3B, in fp32, bf16 and fp16, within each GPU's shared-memory and register limits.

The compile runs in a subprocess: without TRITON_INTERPRET (which other tests set in theirs),
with a Triton cache directory of its own, so every kernel is really compiled (a cached kernel
has no ptxas log and is reported as an error).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"SmolLM2-135M", "Llama-3-8B", "Qwen2.5-7B", "Gemma-3-270M", "Qwen3-30B-A3B"}


def test_every_kernel_compiles_for_sm80_and_sm90_within_limits(smollm2_dir, tmp_path):
    from services.scheduler.triton_aot.compiler import TARGETS  # triton: imported when the test runs

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "aot.json"
    proc = subprocess.run([sys.executable, "bench/triton_aot.py", "--smollm2", str(smollm2_dir), "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    print(proc.stdout.splitlines()[-1], "\nspilling:", report["spills"])
    rows = report["compiled"]
    assert report["unlaunched"] == [] and report["over_limits"] == {}
    assert report["models"] == sorted(MODELS)
    assert [r for r in rows if r["error"] or not 0 < r["registers"] <= 255 or r["shared"] <= 0] == []
    # One row per distinct specialization and target: per target, the attention kernels at
    # head_dim 64, 128, 256 in three dtypes (Gemma 3's 256 with and without its window), plus
    # soft-capping in bf16 at Gemma 3's; the GEMM with and without bias; the RMSNorm at four
    # row widths; the grouped GEMM's two passes; the segmented LoRA kernel's shrink and expand.
    per_target = {"_decode_kernel": 10, "_extend_kernel": 14, "_matmul_kernel": 6, "_rms_norm_kernel": 12,
                  "_grouped_gemm_kernel": 6, "_sgmv_kernel": 6}
    assert Counter((r["kernel"], r["target"]) for r in rows) == {
        (k, t.name): n for k, n in per_target.items() for t in TARGETS}
    assert {r["dtype"] for r in rows} == {"fp32", "bf16", "fp16"}
    seen = {k: {json.dumps(r["constexprs"], sort_keys=True) for r in rows if r["kernel"] == k} for k in per_target}
    consts = lambda kernel, key: {json.loads(c).get(key) for c in seen[kernel]}  # noqa: E731
    assert consts("_extend_kernel", "HEAD_DIM") == consts("_decode_kernel", "HEAD_DIM") == {64, 128, 256}
    assert consts("_extend_kernel", "WINDOWED") == consts("_decode_kernel", "SOFTCAP") == {False, True}
    assert consts("_matmul_kernel", "HAS_BIAS") == {False, True}
    assert consts("_rms_norm_kernel", "BLOCK_H") == {128, 1024, 2048, 4096}
    assert {(json.loads(c)["TOP_K"], json.loads(c)["MUL_WEIGHT"]) for c in seen["_grouped_gemm_kernel"]} == {
        (8, False), (1, True)}
    assert {m for r in rows if r["kernel"] == "_extend_kernel" for m in r["models"]} == MODELS
    assert {m for r in rows if r["kernel"] == "_grouped_gemm_kernel" for m in r["models"]} == {"Qwen3-30B-A3B"}
    assert consts("_sgmv_kernel", "EXPAND") == {False, True}
    assert {m for r in rows if r["kernel"] == "_sgmv_kernel" for m in r["models"]} == MODELS
    # Attention at head_dim 256 in fp32 took 255 registers and spilled with 4 warps; 8 fit.
    attention = [r for r in rows if r["kernel"] in ("_decode_kernel", "_extend_kernel")]
    assert [r for r in attention if r["spill_stores"] or r["spill_loads"]] == []
    assert {(r["dtype"], r["constexprs"]["HEAD_DIM"]) for r in attention if r["num_warps"] == 8} == {("fp32", 256)}


def test_limits_are_checked_per_target():
    from services.scheduler.triton_aot.compiler import TARGETS, Compiled

    sm80, sm90 = TARGETS
    fits = Compiled("k", "sm_80", "bf16", {}, [], num_warps=4, shared=163 * 1024, registers=255)
    assert fits.over_limits(sm80) == []
    big = Compiled("k", "sm_80", "bf16", {}, [], num_warps=8, shared=200_000, registers=255)
    assert big.over_limits(sm80) == ["shared memory 200000 B > 166912 B per block"]
    assert big.over_limits(sm90) == []
    # 33 registers are allocated as 40 per thread: 40 x 2048 threads > 64 K per block.
    wide = Compiled("k", "sm_90", "fp32", {}, [], num_warps=64, shared=16, registers=33)
    assert wide.over_limits(sm90) == ["81920 registers per block (2048 threads) > 65536",
                                      "2048 threads > 1024 per block"]
    broken = Compiled("k", "sm_90", "fp32", {}, [], error="PTXASError: ptxas fatal")
    assert broken.over_limits(sm90) == ["does not compile: PTXASError: ptxas fatal"]
