"""Perplexity and greedy next-token agreement of fp32, int8wo and int8 weights against bf16.

Measured on text no one wrote for this project, the quality gate's corpus
(``ringserve.bench.corpus``: Python's licence and the language reference's topics; the gate
is ``tests/scheduler/test_quantization.py``), through the engine's prompt logprobs. fp32's
agreement with bf16 is the metric's own noise: bf16 logits tie, and any other rounding
breaks the ties otherwise.

    .venv/bin/python bench/int8_quality.py [--tokens 20000] [--model DIR]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ringserve.bench.corpus import python_docs_text
from ringserve.models import DEFAULT_CACHE, SMOLLM2_DIR
from services.scheduler.config import EngineConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.executor.build import apply_quantization
from services.scheduler.models import load_model
from services.scheduler.policy.req import ReqInput, SamplingParams
from services.scheduler.policy.stops import load_eos_ids

WINDOW = 1_000  # tokens per request, as the quality gate scores them


def score(engine: Engine, windows: list[list[int]]) -> tuple[list[float], list[int]]:
    """Every window's prompt logprobs (tokens 1..) and top-1 ids, in order."""
    for i, ids in enumerate(windows):
        engine.add_request(ReqInput(rid=f"w{i}", input_ids=ids, logprob_start_len=0, prompt_top_logprobs_num=1,
                                    sampling=SamplingParams(temperature=0.0, max_new_tokens=1)))
    prompt = {}
    while engine.has_work:
        out = engine.step()
        for p in out.prompt_logprobs if out is not None else ():
            prompt[out.rids[p.row]] = p
    logprobs, top = [], []
    for i in range(len(windows)):
        logprobs += prompt[f"w{i}"].logprobs
        top += prompt[f"w{i}"].top_ids
    return logprobs, top


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_CACHE / "models" / SMOLLM2_DIR)
    p.add_argument("--tokens", type=int, default=20_000)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tok = Tokenizer.from_file(str(a.model / "tokenizer.json"))
    ids = tok.encode(python_docs_text()).ids[: a.tokens]
    windows = [ids[i : i + WINDOW] for i in range(0, len(ids), WINDOW)]
    base = EngineConfig(model=a.model, dtype="bfloat16", max_running_requests=32, max_total_tokens=a.tokens + 4096,
                        seed=0)  # deterministic inference as by default: on for bf16, off for fp32
    runs = {"bf16": (torch.bfloat16, None), "fp32": (torch.float32, None), "int8wo": (torch.bfloat16, "int8wo"),
            "int8": (torch.bfloat16, "int8")}
    ref = None
    print(f"{a.model.name}, {sum(len(w) - 1 for w in windows)} scored tokens")
    print("| weights | perplexity | vs bf16 | greedy agreement with bf16 |\n|---|---|---|---|")
    for name, (dtype, method) in runs.items():
        cfg = replace(base, dtype=str(dtype).removeprefix("torch."), quantization=method)
        model = load_model(a.model, dtype, attention_backend="cpu")
        apply_quantization(model, cfg)
        logprobs, top = score(Engine(model, tok, load_eos_ids(a.model, tok), cfg), windows)
        ppl = math.exp(-sum(logprobs) / len(logprobs))
        ref = ref or (ppl, top)
        agree = sum(x == y for x, y in zip(ref[1], top, strict=True)) / len(top)
        print(f"| {name} | {ppl:.4f} | {ppl / ref[0] - 1:+.2%} | {agree:.2%} |", flush=True)


if __name__ == "__main__":
    main()
