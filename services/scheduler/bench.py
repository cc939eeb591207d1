"""Decode step time of the engine: ``python -m services.scheduler.bench --model DIR``.

Runs ``batch`` greedy requests (ignore_eos) through prefill, then times decode steps:
wall time and the process's CPU time (on a machine shared with other work the CPU time is
the steadier figure; with one torch thread it is the step's single-core cost).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from services.scheduler.config import ATTENTION_BACKENDS, DTYPES, EngineConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.engine.req import ReqInput, SamplingParams


def decode_step_ms(engine: Engine, batch: int, prompt_len: int, steps: int) -> tuple[float, float]:
    """Median wall time and median process CPU time of one decode step (ms, ms) at
    ``batch`` requests of ``prompt_len`` tokens."""
    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        ids = [(i * 7919 + j * 31) % 40000 + 100 for j in range(prompt_len)]
        engine.add_request(ReqInput(rid=f"b{batch}-{i}", input_ids=ids, sampling=params))
    while len(engine.policy.running) < batch or engine.policy.waiting:
        engine.step()
    times, cpu = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        engine.step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    engine.abort()
    engine.step()
    return statistics.median(times) * 1e3, statistics.median(cpu) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--attention-backend", nargs="+", default=["auto"], choices=ATTENTION_BACKENDS,
                   help="one or more; with two, the second's CPU time per step is compared to the first's")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    cpu_ms_of: dict[tuple[str, int], float] = {}
    for backend in a.attention_backend:
        engine = Engine.from_config(EngineConfig(model=a.model, dtype=a.dtype, max_total_tokens=32768,
                                                 attention_backend=backend))
        for b in a.batch:
            ms, cpu_ms = decode_step_ms(engine, b, a.prompt_len, a.steps)
            cpu_ms_of[backend, b] = cpu_ms
            print(f"backend={backend} dtype={a.dtype} batch={b} prompt_len={a.prompt_len}: decode step {ms:.1f} ms "
                  f"({b / ms * 1e3:.0f} tok/s), CPU {cpu_ms:.1f} ms")
        del engine
    if len(a.attention_backend) == 2:
        base, new = a.attention_backend
        for b in a.batch:
            print(f"batch={b}: CPU per step {base}/{new} = {cpu_ms_of[base, b] / cpu_ms_of[new, b]:.2f}x")


if __name__ == "__main__":
    main()
