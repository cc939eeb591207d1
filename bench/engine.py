"""Decode step time of the engine: ``.venv/bin/python bench/engine.py --model DIR``.

Runs ``batch`` greedy requests (ignore_eos) through prefill, then times decode steps:
wall time and the process's CPU time (on a machine shared with other work the CPU time is
the steadier figure; with one torch thread it is the step's single-core cost).

``--tp-size 1 2`` runs each size in turn: rank 0 is this process, the other ranks are the
processes ``executor.tp.TPGroup`` spawns (``--threads`` torch threads each); the CPU time is
rank 0's alone.

``--preset NAME`` benchmarks a model shape no package ships, with random weights: the
preset's config.json beside --model's tokenizer files (see ``PRESETS``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ringserve.options.names import ATTENTION_BACKENDS, DTYPES
from services.scheduler.config import EngineConfig, SchedulerConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.executor.tp import TPGroup
from services.scheduler.layers.parallel import TensorParallel
from services.scheduler.policy.req import FinishType, ReqInput, SamplingParams

# Qwen3-30B-A3B's shape (48 layers, hidden 2048, 32 q / 4 KV heads of 128, 128 experts of
# 768, top-8 renormalized, q/k norm) scaled to two CPU cores: 4 layers, hidden 512, 8 q / 2 KV
# heads of 64, 16 experts of 192 (the same 0.375 x hidden), top-4 renormalized.
PRESETS: dict[str, dict] = {
    "qwen3-moe-small": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, intermediate_size=1536, num_experts=16,
        num_experts_per_tok=4, moe_intermediate_size=192, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096, hidden_act="silu",
        tie_word_embeddings=False),
}


def preset_dir(model: Path, preset: str, out: Path) -> Path:
    """Fill the directory ``out`` (returned) as a model directory: ``PRESETS[preset]`` as
    config.json (vocabulary size and EOS ids from ``model``'s config), ``model``'s tokenizer
    files linked beside it."""
    base = json.loads((model / "config.json").read_text())
    cfg = {k: base[k] for k in ("vocab_size", "bos_token_id", "eos_token_id") if k in base}
    (out / "config.json").write_text(json.dumps({**cfg, **PRESETS[preset]}))
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "generation_config", "special_tokens")):
            (out / f.name).symlink_to(f.resolve())
    return out


def start_decoding(engine: Engine, batch: int, prompt_len: int, new_tokens: int) -> None:
    """Add ``batch`` greedy requests of ``prompt_len`` tokens (``new_tokens`` each, EOS ignored)
    and step until all of them are prefilled and decoding.

    Raises:
        ValueError: the engine refused a request.
    """
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        ids = [(i * 7919 + j * 31) % 40000 + 100 for j in range(prompt_len)]
        engine.add_request(ReqInput(rid=f"b{batch}-{i}", input_ids=ids, sampling=params))
    while len(engine.policy.running) < batch or engine.policy.waiting:
        out = engine.step()
        if out is not None and any(f is not None and f.type == FinishType.ABORT for f in out.finish_reasons):
            raise ValueError(f"a benchmark request was refused: {out.finish_reasons}")


def decode_step_ms(engine: Engine, batch: int, prompt_len: int, steps: int) -> tuple[float, float]:
    """Median wall time and median process CPU time of one decode step (ms, ms) at
    ``batch`` requests of ``prompt_len`` tokens."""
    start_decoding(engine, batch, prompt_len, steps + 2)
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
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="random weights of this built-in shape (implies --load-format dummy); tokenizer from --model")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--attention-backend", nargs="+", default=["auto"], choices=("auto", *ATTENTION_BACKENDS),
                   help="one or more; with two, the second's CPU time per step is compared to the first's")
    p.add_argument("--cuda-graph", choices=["on", "off", "both"], default="on",
                   help="CUDA: decode from CUDA graphs, eagerly, or both side by side (ratios printed)")
    p.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "int8", "int8wo"],
                   help="weights: the checkpoint's (none) and/or int8 (layers.quant); with two, step-time ratios "
                        "are printed")
    p.add_argument("--tp-size", type=int, nargs="+", default=[1],
                   help="tensor-parallel sizes to run in turn (ranks > 0 are spawned processes)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    graph_modes = {"on": [False], "off": [True], "both": [True, False]}[a.cuda_graph]
    model_dir, load_format = Path(a.model), a.load_format
    with tempfile.TemporaryDirectory(prefix="ringserve-bench-") as tmp:
        if a.preset:
            model_dir, load_format = preset_dir(model_dir, a.preset, Path(tmp)), "dummy"
        return _run(a, model_dir, load_format, graph_modes)


def _run(a: argparse.Namespace, model_dir: Path, load_format: str, graph_modes: list[bool]) -> list[dict]:
    """Time every (backend, graph mode, tp size, batch) of the parsed arguments ``a``; one row each."""
    rows: list[dict] = []
    ms_of: dict[tuple[str, bool, int], tuple[float, float]] = {}
    quant_ms: dict[tuple[str, int], float] = {}
    for backend, quant in [(b, q) for q in a.quantization for b in a.attention_backend]:
        for disable_graph in graph_modes:
            for tp_size in a.tp_size:
                cfg = EngineConfig(model=model_dir, dtype=a.dtype, device=a.device, load_format=load_format,
                                   max_total_tokens=max(32768, max(a.batch) * (a.prompt_len + a.steps + 4)),
                                   max_running_requests=max(64, max(a.batch)), attention_backend=backend,
                                   disable_cuda_graph=disable_graph,
                                   quantization=None if quant == "none" else quant)
                group = TPGroup.start(SchedulerConfig(engine=cfg, tp_size=tp_size, torch_threads=a.threads)) \
                    if tp_size > 1 else None
                try:
                    engine = Engine.from_config(cfg, group.tp if group else TensorParallel())
                    if group is not None:
                        group.attach(engine)
                    # The grammar backend loads in a worker thread from start-up; timing beside it
                    # doubled the first batch size's step (CPU time counts every thread).
                    engine.grammars.backend  # noqa: B018 (blocks until loaded)
                    for b in a.batch:
                        ms, cpu_ms = decode_step_ms(engine, b, a.prompt_len, a.steps)
                        if tp_size == a.tp_size[0] and quant == a.quantization[0]:  # ratios: the first size and weights
                            ms_of[backend, disable_graph, b] = ms, cpu_ms
                        if tp_size == a.tp_size[0] and backend == a.attention_backend[0]:
                            quant_ms[quant, b] = ms
                        rows.append(dict(model=a.preset or Path(a.model).name, device=a.device, dtype=a.dtype,
                                         backend=backend, quantization=quant,
                                         cuda_graph=not disable_graph and engine.runner.graph_runner is not None,
                                         tp_size=tp_size, batch=b, step_ms=round(ms, 3), cpu_ms=round(cpu_ms, 3),
                                         tok_s=round(b / ms * 1e3, 1)))
                        print(f"backend={backend} graphs={rows[-1]['cuda_graph']} tp={tp_size} dtype={a.dtype} "
                              f"weights={quant} "
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
    if len(a.quantization) == 2:
        base, new = a.quantization
        for b in a.batch:
            print(f"batch={b}: decode step {base}/{new} = {quant_ms[base, b] / quant_ms[new, b]:.2f}x")
    if len(graph_modes) == 2:
        for backend in a.attention_backend:
            for b in a.batch:
                print(f"backend={backend} batch={b}: eager/graph step time = "
                      f"{ms_of[backend, True, b][0] / ms_of[backend, False, b][0]:.2f}x")
    return rows


if __name__ == "__main__":
    main()
