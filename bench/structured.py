"""Cost of constrained decoding in the engine, side by side with the same workload unconstrained.

    .venv/bin/python bench/structured.py [--model DIR] [--concurrency 1 32] [--grammar-backend llguidance xgrammar]

For each grammar backend and concurrency C: C greedy chat requests run to the end
unconstrained, then the same C requests under a JSON schema (each request a different
schema, so every one compiles); prints output tokens per second of both and their ratio,
the time the engine thread spent on masks and matcher updates per constrained token, and
grammar compile time p50/p99 over the compiles of the run (cold: no cache hit).

Torch runs one thread (``--threads``), so the engine thread's CPU time (``time.thread_time``)
is the whole cost of a step: on a machine shared with other work, the CPU-time ratio is the
steady figure and the wall-clock one the noisy one. Compiles run in the worker thread and
are not in the engine thread's CPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ringserve.models import DEFAULT_CACHE
from services.scheduler.config import EngineConfig
from services.scheduler.engine import engine as engine_module
from services.scheduler.engine.engine import Engine
from services.scheduler.policy.grammar_backends import GrammarSpec
from services.scheduler.policy.req import ReqInput, SamplingParams

MAX_NEW_TOKENS = 96


def schema(i: int) -> dict:
    """A record list schema; ``i`` renames a property so each request compiles its own grammar."""
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               f"age_{i}": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]}},
              "required": ["name", f"age_{i}", "city"], "additionalProperties": False}
    return {"type": "object", "properties": {"people": {"type": "array", "items": person, "minItems": 4,
                                                        "maxItems": 4}},
            "required": ["people"], "additionalProperties": False}


class MaskTimer:
    """Wraps the engine's grammar hooks: seconds spent and constrained tokens seen."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.tokens = 0
        self._apply, self._accept = engine_module.apply_grammar_masks, engine_module.accept_grammar_tokens

    def apply(self, logits, reqs):
        t = time.thread_time()
        out = self._apply(logits, reqs)
        self.seconds += time.thread_time() - t
        self.tokens += sum(r.grammar is not None for r in reqs)
        return out

    def accept(self, reqs):
        t = time.thread_time()
        self._accept(reqs)
        self.seconds += time.thread_time() - t

    def install(self) -> None:
        engine_module.apply_grammar_masks, engine_module.accept_grammar_tokens = self.apply, self.accept


def run(engine: Engine, prompts: list[list[int]], constrained: bool, tag: str) -> tuple[float, float, int]:
    """(wall seconds, engine-thread CPU seconds, output tokens) of one batch run to the end."""
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=not constrained)
    started, cpu = time.perf_counter(), time.thread_time()
    for i, ids in enumerate(prompts):
        grammar = GrammarSpec("json_schema", json.dumps(schema(hash((tag, i)) % 10**6))) if constrained else None
        engine.add_request(ReqInput(rid=f"{tag}-{i}", input_ids=ids, sampling=params, grammar=grammar))
    tokens = 0
    while engine.has_work:
        out = engine.step()
        if out is None:
            time.sleep(0.001)  # grammars compiling in the worker thread
            continue
        tokens += sum(out.new_token_counts)
    return time.perf_counter() - started, time.thread_time() - cpu, tokens


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_CACHE / "models" / "SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    p.add_argument("--grammar-backend", nargs="+", default=["llguidance", "xgrammar"])
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: thread CPU time is the step's cost)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    tok = Tokenizer.from_file(str(a.model / "tokenizer.json"))
    timer = MaskTimer()
    timer.install()
    for backend in a.grammar_backend:
        engine = Engine.from_config(EngineConfig(model=a.model, dtype=a.dtype, max_total_tokens=65536,
                                                 grammar_backend=backend, grammar_compile_timeout_s=60))
        engine.grammars.backend  # loaded before timing  # noqa: B018
        compiles: list[float] = []
        engine.grammars.observe_compile = compiles.append
        for c in a.concurrency:
            prompts = [tok.encode(f"<|im_start|>user\nList four people (name, age, city) as JSON. Set {i}."
                                  f"<|im_end|>\n<|im_start|>assistant\n").ids for i in range(c)]
            run(engine, prompts[:1], False, f"warm-{backend}-{c}")
            plain_s, plain_cpu, plain_tok = run(engine, prompts, False, f"plain-{backend}-{c}")
            compiles.clear()
            timer.seconds, timer.tokens = 0.0, 0
            json_s, json_cpu, json_tok = run(engine, prompts, True, f"json-{backend}-{c}")
            ordered = sorted(compiles)
            p50 = statistics.median(ordered) * 1e3
            p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3
            plain_tps, json_tps = plain_tok / plain_s, json_tok / json_s
            cpu_ratio = (plain_cpu / plain_tok) / (json_cpu / json_tok)
            print(f"{backend:10} c={c:<3} tok/s unconstrained {plain_tps:6.1f} json_schema {json_tps:6.1f} "
                  f"(wall ratio {json_tps / plain_tps:.2f}x, CPU ratio {cpu_ratio:.2f}x)  mask+accept "
                  f"{timer.seconds / max(timer.tokens, 1) * 1e6:4.0f} us CPU/token  compile p50 {p50:.1f} ms "
                  f"p99 {p99:.1f} ms (n={len(ordered)})", flush=True)
        del engine


if __name__ == "__main__":
    main()
