"""Scheduler test fixtures: the SmolLM2 model loaded once, engines built around it."""

from __future__ import annotations

import os
import time

# Effective only if torch is not imported yet: idle OpenMP workers sleep instead of
# spinning, which keeps these tests fast while other processes share the cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from services.scheduler.config import EngineConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.models import load_model
from services.scheduler.policy.stops import load_eos_ids
from tests.helpers.engine_steps import Result, collect, greedy

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


@pytest.fixture(scope="session")
def greedy_req():
    return greedy


@pytest.fixture(scope="session")
def chat_ids(tokenizer):
    """ChatML prompt ids for one user turn (SmolLM2-Instruct's template)."""

    def ids(text: str) -> list[int]:
        return tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids

    return ids
