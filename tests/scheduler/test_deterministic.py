"""Deterministic inference (issue 14): with it, a request's token ids and logprobs do not depend
on what else is in the batch, on chunk boundaries or on prefix-cache hits.

SmolLM2 in bf16 (the default dtype) on the cpu attention backend; 50 prompts, 5 of them
sampled with a seed, each run (a) alone on a cold engine, (b) again once its prompt is
cached, (c) among 63 other concurrent requests, (d) with a chunked-prefill size that splits
it, beside the decodes of the others. Deterministic: the four give identical ids and
logprobs. How many differ with the default arithmetic (deterministic inference off) is
measured by bench/deterministic_effect.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.scheduler.engine.engine import Engine
from services.scheduler.engine.req import ReqInput, SamplingParams
from services.scheduler.layers import batch_invariant
from services.scheduler.layers.batch_invariant import (NotBatchInvariantError, RowPaddedLinear, make_batch_invariant,
                                                       measure)
from services.scheduler.models import load_model
from tests.helpers.engine_steps import Result, collect

NEW_TOKENS = 8
TOPICS = ["the sea", "a robot", "bread", "winter", "a lighthouse", "chess", "rain", "a violin", "mountains", "a library"]


def _bf16_factory(smollm2_dir, tokenizer, make_engine):
    model = load_model(smollm2_dir, torch.bfloat16, attention_backend="cpu")
    base = make_engine()

    def make(**overrides) -> Engine:
        cfg = replace(base.cfg, max_running_requests=64, max_total_tokens=8192, **overrides)
        return Engine(model, tokenizer, base.stops.eos_ids, cfg)

    return make


@pytest.fixture(scope="module")
def bf16_engine(smollm2_dir, tokenizer, make_engine):
    """Factory of engines over a bf16 SmolLM2 with the cpu backend (its own model: the
    deterministic engines pad some of its linears in place)."""
    return _bf16_factory(smollm2_dir, tokenizer, make_engine)


def _prompts(chat_ids) -> list[list[int]]:
    return [chat_ids(f"Write {i % 5 + 2} sentences about {TOPICS[i % 10]}, number {i}.") for i in range(64)]


def _request(i: int, ids: list[int]) -> ReqInput:
    seeded = i % 10 == 9  # 5 of the 50 sample with their own seed
    sampling = SamplingParams(temperature=0.8 if seeded else 0.0, top_p=0.9 if seeded else 1.0,
                              seed=1000 + i if seeded else None, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return ReqInput(rid=f"p{i}", input_ids=ids, return_logprob=True, sampling=sampling)


def _run(engine: Engine, requests: list[ReqInput]) -> dict[str, Result]:
    for req in requests:
        engine.add_request(req)
    results: dict[str, Result] = {}
    while engine.has_work:
        out = engine.step()
        if out is not None:
            collect(out, results)
    return results


def _four_ways(make, prompts, deterministic: bool, count: int = 50) -> dict[str, dict[str, Result]]:
    """The first ``count`` prompts alone (cold, then cached) and chunked; all 64 together."""
    reqs = [_request(i, ids) for i, ids in enumerate(prompts)]
    cold, cached = {}, {}
    for req in reqs[:count]:
        engine = make(deterministic_inference=deterministic)
        cold.update(_run(engine, [req]))
        cached.update(_run(engine, [req]))
        assert cached[req.rid].cached_tokens == len(req.input_ids) - 1
    concurrent = _run(make(deterministic_inference=deterministic), reqs)
    chunk = 16  # every prompt here is longer: each is prefilled in two or three chunks
    assert min(len(ids) for ids in prompts) > chunk
    chunked = _run(make(deterministic_inference=deterministic, chunked_prefill_size=chunk, disable_radix_cache=True),
                   reqs[:count])
    return {"cold": cold, "cached": cached, "concurrent": concurrent, "chunked": chunked}


def _differing(runs: dict[str, dict[str, Result]]) -> dict[str, int]:
    cold = runs["cold"]
    return {way: sum((r.output_ids, r.logprobs) != (cold[rid].output_ids, cold[rid].logprobs)
                     for rid, r in runs[way].items() if rid in cold)
            for way in ("cached", "concurrent", "chunked")}


def test_deterministic_inference_gives_the_same_tokens_and_logprobs_four_ways(bf16_engine, chat_ids):
    prompts = _prompts(chat_ids)
    runs = _four_ways(bf16_engine, prompts, deterministic=True)
    cold = runs["cold"]
    assert len(cold) == 50 and all(len(r.output_ids) == len(r.logprobs) == NEW_TOKENS for r in cold.values())
    for way in ("cached", "concurrent", "chunked"):
        for rid, want in cold.items():
            got = runs[way][rid]
            assert got.output_ids == want.output_ids, (way, rid)
            assert got.logprobs == want.logprobs, (way, rid)  # bit for bit, not approx
    assert _differing(runs) == {"cached": 0, "concurrent": 0, "chunked": 0}


def test_default_is_on_for_bf16_on_the_cpu_only(bf16_engine, make_engine, smollm2_dir, tokenizer):
    assert bf16_engine().deterministic is True
    assert bf16_engine(deterministic_inference=False).deterministic is False
    assert make_engine().deterministic is False  # the fp32 model: padding small batches to 15 rows is not free
    torch_backend = load_model(smollm2_dir, torch.bfloat16, attention_backend="torch")
    engine = make_engine()
    auto = Engine(torch_backend, tokenizer, engine.stops.eos_ids, engine.cfg)
    assert auto.deterministic is False
    with pytest.raises(ValueError, match="needs a batch-invariant attention backend .cpu or triton., not 'torch'"):
        Engine(torch_backend, tokenizer, engine.stops.eos_ids, replace(engine.cfg, deterministic_inference=True))


def test_fp32_linears_are_padded_to_their_floor_and_then_agree():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(576, 1536, bias=False), torch.nn.Linear(1536, 576, bias=False))
    wrapped = make_batch_invariant(model, max_rows=256)
    assert set(wrapped) == {"0", "1"} and all(isinstance(m, RowPaddedLinear) for m in model)
    floor = wrapped["0"]
    assert 1 < floor <= batch_invariant.MAX_PAD_ROWS
    assert make_batch_invariant(model, max_rows=256) == {}  # idempotent
    x = torch.randn(64, 576) * torch.exp2(torch.randint(-12, 13, (64, 576)).float())
    with torch.inference_mode():
        full = model(x)
        assert all(torch.equal(model(x.narrow(0, i, 1)), full.narrow(0, i, 1)) for i in range(64))
        assert model(x.narrow(0, 0, 3)).shape == (3, 576)


def test_a_gemm_that_depends_on_the_row_count_is_refused(monkeypatch):
    def row_count_dependent(linear):
        return lambda x: torch.nn.functional.linear(x, linear.weight) + x.shape[0] * 1e-3

    monkeypatch.setattr(batch_invariant, "_call", row_count_dependent)
    with pytest.raises(NotBatchInvariantError, match=r"\[64, 32\] torch.float32 linear on cpu .* at row counts \[1, 2,"):
        measure(32, 64, torch.float32, "cpu", False, torch.get_num_threads(), 128)


def test_probe_results_persist_in_the_kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path))
    batch_invariant.probe.cache_clear()
    try:
        floor = batch_invariant.probe(48, 40, torch.float32, "cpu", False, torch.get_num_threads(), 64)
        files = list((tmp_path / "kernels").glob("batch-invariance-*.json"))
        assert len(files) == 1
        text = files[0].read_text()
        assert f'"48x40 torch.float32 packed=False threads={torch.get_num_threads()} rows=64": {floor}' in text
        batch_invariant.probe.cache_clear()
        monkeypatch.setattr(batch_invariant, "measure", lambda *a: pytest.fail("measured again"))
        assert batch_invariant.probe(48, 40, torch.float32, "cpu", False, torch.get_num_threads(), 64) == floor
    finally:
        batch_invariant.probe.cache_clear()
