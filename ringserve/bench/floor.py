"""The memory-bandwidth floor of one decode step: every weight byte is read once per step,
so at batch 1 a step cannot take less than ``weight bytes / memory bandwidth``."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

# Bytes a decode step reads per weight: the model dtypes; ringserve's int8 (per-channel
# scales, 4 bytes per output channel, left out); llama.cpp's blocks of 32 weights (Q8_0:
# 32 int8 and an fp16 scale; Q4_1: 32 nibbles, an fp16 scale and an fp16 minimum).
BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "Q8_0": 34 / 32, "Q4_1": 20 / 32}


def param_count(model_dir: Path) -> int:
    """Number of weight elements in ``model_dir/*.safetensors`` (read from the headers only)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= d
                total += count
    return total


def copy_bandwidth_gbps(size_mib: int = 256, repeats: int = 5) -> float:
    """Best-of-``repeats`` bandwidth (GB/s, 1e9 B/s) of copying ``size_mib`` MiB with numpy,
    counting bytes read plus bytes written (the STREAM "copy" convention)."""
    import numpy as np

    src = np.ones(size_mib * 2**20, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


def decode_floor_ms(model_dir: Path, dtype: str, bandwidth_gbps: float) -> float:
    """Lower bound (ms) of one batch-1 decode step: weight bytes in ``dtype`` (a key of
    ``BYTES_PER_ELEMENT``: a model dtype or a weight format) / bandwidth.

    Tied embeddings are counted once: the LM head reads the whole matrix each step, the
    embedding lookup only one row.
    """
    return param_count(model_dir) * BYTES_PER_ELEMENT[dtype] / (bandwidth_gbps * 1e9) * 1000


def itl_ratios(itl_ms: dict[str, float], floor_ms: dict[str, float], engine_ms: dict[str, float]) -> str:
    """One line: each server's served median ITL at concurrency 1 over the batch-1 floor of its
    weights (``floor_ms``, by server) and over the engine alone's batch-1 decode step
    (``engine_ms``, by server; servers without one get the floor ratio only). What a served
    token costs beyond the bytes it must read, and beyond the engine's own step."""
    parts = []
    for server, itl in itl_ms.items():
        part = f"{server} {itl / floor_ms[server]:.1f}x the floor"
        if server in engine_ms:
            part += f", {itl / engine_ms[server]:.2f}x the engine alone ({engine_ms[server]:.1f} ms)"
        parts.append(part)
    return "served median ITL at concurrency 1: " + "; ".join(parts)
