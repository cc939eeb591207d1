"""How many greedy or seeded outputs change with the batch, with deterministic inference on and off.

SmolLM2 in bf16 on the cpu attention backend, the engine alone: each prompt (8 tokens of
output, with logprobs; every tenth sampled with a seed) runs alone on a cold engine, then
again once its prompt is cached, then among 63 other concurrent requests, then with a
16-token chunked prefill beside the decodes of the others. A prompt differs in a way when
its ids or logprobs differ from the cold run's. ``tests/scheduler/test_deterministic.py``
asserts 0 of 50 with it on; this prints both.

    .venv/bin/python bench/deterministic_effect.py [--prompts 20] [--model DIR]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ringserve.models import DEFAULT_CACHE, SMOLLM2_DIR
from services.scheduler.config import EngineConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.layers.batch_invariant import NotBatchInvariantError
from services.scheduler.models import load_model
from services.scheduler.policy.req import ReqInput, SamplingParams
from services.scheduler.policy.stops import load_eos_ids

TOPICS = ["the sea", "a robot", "bread", "winter", "a lighthouse", "chess", "rain", "a violin", "mountains",
          "a library"]
CONCURRENT = 64
CHUNK = 16


def requests(tok: Tokenizer) -> list[ReqInput]:
    out = []
    for i in range(CONCURRENT):
        text = f"Write {i % 5 + 2} sentences about {TOPICS[i % 10]}, number {i}."
        ids = tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids
        seeded = i % 10 == 9
        sampling = SamplingParams(temperature=0.8 if seeded else 0.0, top_p=0.9 if seeded else 1.0,
                                  seed=1000 + i if seeded else None, max_new_tokens=8, ignore_eos=True)
        out.append(ReqInput(rid=f"p{i}", input_ids=ids, return_logprob=True, sampling=sampling))
    return out


def run(engine: Engine, reqs: list[ReqInput]) -> dict[str, tuple[list[int], list[float]]]:
    """rid -> (output ids, their logprobs)."""
    for req in reqs:
        engine.add_request(req)
    out: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_work:
        step = engine.step()
        if step is None:
            continue
        pos = lp = 0
        for row, rid in enumerate(step.rids):
            ids, logprobs = out.setdefault(rid, ([], []))
            n, k = step.new_token_counts[row], step.logprob_counts[row]
            ids += step.output_ids[pos : pos + n]
            logprobs += step.output_token_logprobs[lp : lp + k]
            pos, lp = pos + n, lp + k
    return out


def differing(model: torch.nn.Module, tok: Tokenizer, cfg: EngineConfig, reqs: list[ReqInput],
              count: int) -> dict[str, int]:
    """Of the first ``count`` requests, how many differ from the cold run in each way."""
    eos = load_eos_ids(cfg.model, tok)

    def make(**overrides) -> Engine:
        return Engine(model, tok, eos, replace(cfg, **overrides))

    cold, cached = {}, {}
    for req in reqs[:count]:
        engine = make()
        cold.update(run(engine, [req]))
        cached.update(run(engine, [req]))
    ways = {"cached": cached, "concurrent": run(make(), reqs),
            "chunked": run(make(chunked_prefill_size=CHUNK, disable_radix_cache=True), reqs[:count])}
    return {way: sum(got[rid] != cold[rid] for rid in cold) for way, got in ways.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_CACHE / "models" / SMOLLM2_DIR)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tok = Tokenizer.from_file(str(a.model / "tokenizer.json"))
    reqs = requests(tok)
    print(f"{a.model.name} bf16, of {a.prompts} prompts, how many differ from their cold run")
    print("| deterministic inference | cached | among 63 concurrent | chunked |\n|---|---|---|---|")
    for on in (True, False):
        # A model of its own each time: deterministic engines pad some linears in place.
        model = load_model(a.model, torch.bfloat16, attention_backend="cpu")
        cfg = EngineConfig(model=a.model, dtype="bfloat16", max_running_requests=CONCURRENT, max_total_tokens=8192,
                           seed=0, deterministic_inference=on)
        try:
            d = differing(model, tok, cfg, reqs, a.prompts)
        except NotBatchInvariantError as exc:  # deterministic inference cannot run on this CPU
            print(f"| on | {exc} | | |", flush=True)
            continue
        print(f"| {'on' if on else 'off'} | {d['cached']} | {d['concurrent']} | {d['chunked']} |", flush=True)


if __name__ == "__main__":
    main()
