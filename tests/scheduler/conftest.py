"""Scheduler test fixtures: the SmolLM2 model loaded once, engines built around it."""

from __future__ import annotations

import os
import time

# Effective only if torch is not imported yet: idle OpenMP workers sleep instead of
# spinning, which keeps these tests fast while other processes share the cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from services.scheduler.config import EngineConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.engine.req import FinishReason, ReqInput, SamplingParams
from services.scheduler.engine.stops import load_eos_ids
from services.scheduler.models import load_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def sched_model(smollm2_dir: Path) -> torch.nn.Module:
    return load_model(smollm2_dir, torch.float32)


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def make_engine(smollm2_dir, sched_model, tokenizer):
    """Factory: an Engine over the shared model with its own pools (EngineConfig overrides as kwargs)."""
    eos = load_eos_ids(smollm2_dir, tokenizer)
    base = EngineConfig(model=smollm2_dir, max_running_requests=32, max_total_tokens=16384, seed=0)

    def make(**overrides) -> Engine:
        return Engine(sched_model, tokenizer, eos, replace(base, **overrides))

    return make


@dataclass
class Result:
    """Everything the engine emitted for one rid."""

    output_ids: list[int] = field(default_factory=list)
    rows: int = 0
    init_rows: list[int] = field(default_factory=list)  # step indices of rows carrying RowInit
    finish: FinishReason | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)
    top_vals: list[float] = field(default_factory=list)
    top_width: int = 0
    prompt_start: int | None = None  # prompt logprobs (issue 14), once per rid
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_ids: list[int] = field(default_factory=list)
    prompt_top_vals: list[float] = field(default_factory=list)


def collect(out, results: dict[str, Result], step: int = 0) -> None:
    """Fold one StepOutput into per-rid Results, checking the columnar layout as it goes."""
    inits = {i.row: i for i in out.inits}
    pos = lp = top = 0
    for row, rid in enumerate(out.rids):
        res = results.setdefault(rid, Result())
        n = out.new_token_counts[row]
        res.output_ids.extend(out.output_ids[pos : pos + n])
        pos += n
        res.rows += 1
        if row in inits:
            res.init_rows.append(step)
            res.top_width = inits[row].top_logprobs_num
        assert res.finish is None, f"{rid} has a row after its final row"
        res.finish = out.finish_reasons[row]
        res.completion_tokens = out.completion_tokens[row]
        res.prompt_tokens = out.prompt_tokens[row]
        res.cached_tokens = out.cached_tokens[row]
        k = out.logprob_counts[row]
        res.logprobs.extend(out.output_token_logprobs[lp : lp + k])
        lp += k
        width = k * res.top_width
        res.top_ids.extend(out.top_logprob_ids[top : top + width])
        res.top_vals.extend(out.top_logprob_vals[top : top + width])
        top += width
    assert (pos, lp, top) == (len(out.output_ids), len(out.output_token_logprobs), len(out.top_logprob_ids))
    for p in out.prompt_logprobs:
        res = results[out.rids[p.row]]
        assert res.prompt_start is None, "prompt logprobs are sent once"
        assert len(p.top_ids) == len(p.top_vals) == p.top_n * len(p.logprobs)
        res.prompt_start = p.start
        res.prompt_logprobs, res.prompt_top_ids, res.prompt_top_vals = p.logprobs, p.top_ids, p.top_vals


@pytest.fixture(scope="session")
def run_all():
    """Step an engine until idle; returns {rid: Result}."""

    def run(engine: Engine, results: dict[str, Result] | None = None, max_steps: int = 10_000) -> dict[str, Result]:
        results = {} if results is None else results
        step = 0
        while engine.has_work and step < max_steps:
            out = engine.step()
            if out is not None:
                collect(out, results, step)
            elif engine.only_compiling:
                time.sleep(0.005)  # grammars compile in the engine's worker thread
                continue
            step += 1
        return results

    return run


def greedy(rid: str, ids: list[int], max_new_tokens: int = 16, **kw) -> ReqInput:
    """A greedy request."""
    return ReqInput(rid=rid, input_ids=ids, sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kw))


@pytest.fixture(scope="session")
def greedy_req():
    return greedy


@pytest.fixture(scope="session")
def chat_ids(tokenizer):
    """ChatML prompt ids for one user turn (SmolLM2-Instruct's template)."""

    def ids(text: str) -> list[int]:
        return tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids

    return ids


def run_interpreted(script: str, timeout_s: float = 300) -> dict:
    """Run ``script`` in a subprocess with Triton's interpreter on (TRITON_INTERPRET must be set
    before triton is imported) from the repository root; returns the JSON of its last line."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
