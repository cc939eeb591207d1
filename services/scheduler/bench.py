"""Decode step time of the engine: ``python -m services.scheduler.bench --model DIR``.

Runs ``batch`` greedy requests (ignore_eos) through prefill, then times decode steps:
wall time and the process's CPU time (on a machine shared with other work the CPU time is
the steadier figure; with one torch thread it is the step's single-core cost).

``--tp-size 1 2`` runs each size in turn: rank 0 is this process, the other ranks are the
processes ``engine.tp.TPGroup`` spawns (``--threads`` torch threads each); the CPU time is
rank 0's alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from services.scheduler.config import ATTENTION_BACKENDS, DTYPES, EngineConfig, SchedulerConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.engine.tp import TPGroup
from services.scheduler.layers.parallel import TensorParallel
from services.scheduler.engine.req import FinishType, ReqInput, SamplingParams


def decode_step_ms(engine: Engine, batch: int, prompt_len: int, steps: int) -> tuple[float, float]:
    """Median wall time and median process CPU time of one decode step (ms, ms) at
    ``batch`` requests of ``prompt_len`` tokens."""
    params = SamplingParams(temperature=0.0, max_new_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        ids = [(i * 7919 + j * 31) % 40000 + 100 for j in range(prompt_len)]
        engine.add_request(ReqInput(rid=f"b{batch}-{i}", input_ids=ids, sampling=params))
    while len(engine.policy.running) < batch or engine.policy.waiting:
        out = engine.step()
        if out is not None and any(f is not None and f.type == FinishType.ABORT for f in out.finish_reasons):
            raise ValueError(f"a benchmark request was refused: {out.finish_reasons}")
    times, cpu = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        engine.step()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    engine.abort()
    engine.step()
    return statistics.median(times) * 1e3, statistics.median(cpu) * 1e3


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy = random weights of config.json's shapes (e.g. a Llama-3-8B config)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--attention-backend", nargs="+", default=["auto"], choices=ATTENTION_BACKENDS,
                   help="one or more; with two, the second's CPU time per step is compared to the first's")
    p.add_argument("--cuda-graph", choices=["on", "off", "both"], default="on",
                   help="CUDA: decode from CUDA graphs, eagerly, or both side by side (ratios printed)")
    p.add_argument("--tp-size", type=int, nargs="+", default=[1],
                   help="tensor-parallel sizes to run in turn (ranks > 0 are spawned processes)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    graph_modes = {"on": [False], "off": [True], "both": [True, False]}[a.cuda_graph]
    rows: list[dict] = []
    ms_of: dict[tuple[str, bool, int], tuple[float, float]] = {}
    for backend in a.attention_backend:
        for disable_graph in graph_modes:
            for tp_size in a.tp_size:
                cfg = EngineConfig(model=a.model, dtype=a.dtype, device=a.device, load_format=a.load_format,
                                   max_total_tokens=max(32768, max(a.batch) * (a.prompt_len + a.steps + 4)),
                                   max_running_requests=max(64, max(a.batch)), attention_backend=backend,
                                   disable_cuda_graph=disable_graph)
                group = TPGroup.start(SchedulerConfig(engine=cfg, tp_size=tp_size, torch_threads=a.threads)) \
                    if tp_size > 1 else None
                try:
                    engine = Engine.from_config(cfg, group.tp if group else TensorParallel())
                    if group is not None:
                        group.attach(engine)
                    for b in a.batch:
                        ms, cpu_ms = decode_step_ms(engine, b, a.prompt_len, a.steps)
                        if tp_size == a.tp_size[0]:  # the backend and graph ratios compare the first size
                            ms_of[backend, disable_graph, b] = ms, cpu_ms
                        rows.append(dict(model=Path(a.model).name, device=a.device, dtype=a.dtype, backend=backend,
                                         cuda_graph=not disable_graph and engine.runner.graph_runner is not None,
                                         tp_size=tp_size, batch=b, step_ms=round(ms, 3), cpu_ms=round(cpu_ms, 3),
                                         tok_s=round(b / ms * 1e3, 1)))
                        print(f"backend={backend} graphs={rows[-1]['cuda_graph']} tp={tp_size} dtype={a.dtype} "
                              f"batch={b} prompt_len={a.prompt_len}: decode step {ms:.2f} ms ({b / ms * 1e3:.0f} "
                              f"tok/s), CPU {cpu_ms:.1f} ms")
                    del engine
                finally:
                    if group is not None:
                        group.stop()
    if len(a.attention_backend) == 2:
        base, new = a.attention_backend
        for b in a.batch:
            print(f"batch={b}: CPU per step {base}/{new} = "
                  f"{ms_of[base, graph_modes[0], b][1] / ms_of[new, graph_modes[0], b][1]:.2f}x")
    if len(graph_modes) == 2:
        for backend in a.attention_backend:
            for b in a.batch:
                print(f"backend={backend} batch={b}: eager/graph step time = "
                      f"{ms_of[backend, True, b][0] / ms_of[backend, False, b][0]:.2f}x")
    return rows


if __name__ == "__main__":
    main()
