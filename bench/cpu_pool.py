"""The CPU kernels' worker pool against OpenMP regions, engine alone.

``PYTHONPATH=. OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench/cpu_pool.py --model DIR``.

One engine per weight format (bf16, ``int8``, ``int8wo``), all decoding at once. In each of
``--rounds`` rounds every engine runs ``--steps`` pairs of decode steps, one with the C
kernels' parallel regions on OpenMP and one on the persistent worker pool
(``kernels/cpu/parallel.c``), which first alternating, so a machine shared with other work
loads both sides alike. Prints the median step of each side, their ratio (OpenMP / pool: above 1 the pool is
faster), each format's batch-1 floor (weight bytes / measured copy bandwidth) and the pool's
step over it, and each format's step over bf16's. In bf16 only attention, rotary, RMSNorm and
SiLU run on the pool (oneDNN runs the matmuls with torch's OpenMP threads).

Run it under the ring's wait policy (``OMP_WAIT_POLICY=PASSIVE``) unless the cores are idle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from engine import start_decoding

from ringserve.bench.floor import copy_bandwidth_gbps, decode_floor_ms
from services.scheduler.config import EngineConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.kernels import cpu_kernels
from services.scheduler.layers.parallel import TensorParallel

FLOOR_FORMAT = {"none": "bfloat16", "int8": "int8", "int8wo": "int8"}  # ringserve.bench.floor's weight formats
MODES = {"openmp": False, "pool": True}


def timed_step(engine: Engine) -> float:
    """Wall ms of one decode step."""
    t0 = time.perf_counter()
    engine.step()
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--quantization", nargs="+", default=["none", "int8", "int8wo"], choices=list(FLOOR_FORMAT))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per side, engine and round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None,
                   help="write the medians here (ringserve bench compare --engine-alone-json reads them)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    new_tokens = a.rounds * (len(MODES) * a.steps + 1) + 4
    engines = {}
    for quant in a.quantization:
        cfg = EngineConfig(model=a.model, dtype="bfloat16", attention_backend="cpu",
                           quantization=None if quant == "none" else quant,
                           max_total_tokens=max(a.batch) * (a.prompt_len + new_tokens + 4) + 1024,
                           max_running_requests=max(a.batch))
        engines[quant] = Engine.from_config(cfg, TensorParallel())
        engines[quant].grammars.backend  # noqa: B018 (blocks until loaded: timing beside its thread is skewed)
    bandwidth = copy_bandwidth_gbps()
    floors = {q: decode_floor_ms(a.model, FLOOR_FORMAT[q], bandwidth) for q in a.quantization}
    ms: dict[tuple[str, int, str], float] = {}
    for batch in a.batch:
        for engine in engines.values():
            start_decoding(engine, batch, a.prompt_len, new_tokens)
        samples: dict[tuple[str, str], list[float]] = {(q, m): [] for q in engines for m in MODES}
        for r in range(a.rounds):
            for quant, engine in engines.items():
                engine.step()  # untimed: the first step after another engine's
                for i in range(a.steps):  # the sides alternate step by step (order too): both see the same load
                    for mode in list(MODES)[:: 1 if (r + i) % 2 == 0 else -1]:
                        cpu_kernels.set_worker_pool(MODES[mode])
                        samples[quant, mode].append(timed_step(engine))
        cpu_kernels.set_worker_pool(True)
        for engine in engines.values():
            engine.abort()
            engine.step()
        for (quant, mode), values in samples.items():
            ms[quant, batch, mode] = statistics.median(values)
    print(f"copy bandwidth {bandwidth:.1f} GB/s; {a.threads} threads; {a.rounds} rounds x {a.steps} steps per side; "
          f"worker pool of {cpu_kernels.pool_threads()} threads\n")
    print("| weights | batch | OpenMP ms | pool ms | OpenMP / pool | batch-1 floor ms | pool / floor "
          "| pool / bf16 pool |")
    print("|---|---|---|---|---|---|---|---|")
    for quant in a.quantization:
        for batch in a.batch:
            omp, pool = ms[quant, batch, "openmp"], ms[quant, batch, "pool"]
            floor = f"{floors[quant]:.1f} | {pool / floors[quant]:.1f}x" if batch == 1 else " | "  # a batch-1 bound
            vs_bf16 = f"{pool / ms['none', batch, 'pool']:.2f}x" if "none" in engines else ""
            name = "bf16" if quant == "none" else quant
            print(f"| {name} | {batch} | {omp:.2f} | {pool:.2f} | {omp / pool:.2f}x | {floor} | {vs_bf16} |")
    out = {"bandwidth_gbps": bandwidth, "floors_ms": floors,
           "step_ms": {f"{q} {b} {m}": v for (q, b, m), v in ms.items()}}
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
