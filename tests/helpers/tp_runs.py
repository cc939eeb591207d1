"""Running one engine at a tensor-parallel size and comparing two sizes' results (the TP tests' helpers)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from services.scheduler.config import EngineConfig, SchedulerConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.executor.tp import TPGroup
from services.scheduler.layers.parallel import TensorParallel
from tests.helpers.engine_steps import collect, greedy


def run_engine(model_dir: Path, tp_size: int, specs, load_format: str, prepare=None, **engine_kw):
    """Run ``specs`` to the end on a ``tp_size``-rank engine -> (results by rid, logits of every step, final load);
    ``prepare(engine)`` runs first, once the ranks are attached."""
    cfg = SchedulerConfig(engine=EngineConfig(model=model_dir, dtype="float32", load_format=load_format, seed=0,
                                              max_running_requests=8, **engine_kw),
                          tp_size=tp_size, torch_threads=1, dist_timeout_s=60)
    group = TPGroup.start(cfg) if tp_size > 1 else None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine.from_config(cfg.engine, group.tp if group else TensorParallel())
        if group is not None:
            group.attach(engine)
        if prepare is not None:
            prepare(engine)
        steps: list[torch.Tensor] = []
        forward = engine.runner.forward
        engine.runner.forward = lambda plan, future=None: steps.append(forward(plan, future)) or steps[-1]
        for spec in specs:
            engine.add_request(spec)
        results: dict = {}
        while engine.has_work:
            out = engine.step()
            if out is not None:
                collect(out, results)
        return results, steps, engine.load()
    finally:
        torch.set_num_threads(threads)
        if group is not None:
            group.stop()


def assert_same(tp1, tpn) -> None:
    (res1, logits1, _), (resn, logitsn, load) = tp1, tpn
    assert len(logits1) == len(logitsn)
    for a, b in zip(logits1, logitsn, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    assert {rid: r.output_ids for rid, r in resn.items()} == {rid: r.output_ids for rid, r in res1.items()}
    for rid, r in res1.items():
        torch.testing.assert_close(torch.tensor(resn[rid].logprobs), torch.tensor(r.logprobs), atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(resn[rid].prompt_logprobs), torch.tensor(r.prompt_logprobs),
                                   atol=1e-4, rtol=0)
    assert (load.num_running_reqs, load.req_slots_used, load.kv_used_tokens) == (0, 0, 0)


def specs(prompts: list[list[int]], max_new_tokens: int, **sampling) -> list:
    """Greedy requests with their output logprobs; the first also asks for its prompt's."""
    out = [replace(greedy(f"r{i}", p, max_new_tokens, **sampling), return_logprob=True) for i, p in enumerate(prompts)]
    out[0] = replace(out[0], logprob_start_len=1, prompt_top_logprobs_num=2)
    return out
