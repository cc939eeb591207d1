"""Deterministic inference: with it, a request's token ids and logprobs do not depend
on what else is in the batch, on chunk boundaries or on prefix-cache hits.

SmolLM2 in bf16 (the default dtype) on the cpu attention backend; 50 prompts, 5 of them
sampled with a seed, each run (a) alone on a cold engine, (b) again once its prompt is
cached, (c) among 63 other concurrent requests, (d) with a chunked-prefill size that splits
it, beside the decodes of the others. Deterministic: the four give identical ids and
logprobs. How many differ with the default arithmetic (deterministic inference off) is
measured by bench/deterministic_effect.py.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from services.scheduler.engine.engine import Engine
from services.scheduler.executor import step_threads
from services.scheduler.layers import batch_invariant
from services.scheduler.layers.batch_invariant import (
    NotBatchInvariantError,
    RowPaddedLinear,
    make_batch_invariant,
    measure,
)
from services.scheduler.models import load_model
from services.scheduler.policy.req import ReqInput, SamplingParams
from tests.helpers.engine_steps import Result, collect

NEW_TOKENS = 8
TOPICS = ["the sea", "a robot", "bread", "winter", "a lighthouse", "chess", "rain", "a violin", "mountains",
          "a library"]


def _bf16_factory(smollm2_dir, tokenizer, make_engine):
    model = load_model(smollm2_dir, torch.bfloat16, attention_backend="cpu")
    base = make_engine()

    def make(**overrides) -> Engine:
        cfg = replace(base.cfg, max_running_requests=64, max_total_tokens=8192, **overrides)
        engine = Engine(model, tokenizer, base.stops.eos_ids, cfg)
        step_threads.install(engine.runner, 2)  # as served: a 1-token step on one thread, the rest on two
        return engine

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


def test_fp32_linears_are_called_in_their_window_and_then_agree():
    """fp32 (MKL) gives small row counts other bits on every CPU seen: each linear is wrapped
    with a floor above 1, and then a row's bits are the same alone, in a batch of 64, in a call
    padded to a power of two (100 rows) and in one split at the cap (300 rows)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(576, 1536, bias=False), torch.nn.Linear(1536, 576, bias=False))
    wrapped = make_batch_invariant(model, max_rows=256)
    assert set(wrapped) == {"0", "1"} and all(isinstance(m, RowPaddedLinear) for m in model)
    assert all(1 < w.floor <= batch_invariant.MAX_PAD_ROWS and w.cap >= w.floor for w in wrapped.values())
    assert make_batch_invariant(model, max_rows=256) == {}  # idempotent
    x = torch.randn(300, 576) * torch.exp2(torch.randint(-12, 13, (300, 576)).float())
    with torch.inference_mode():
        full = model(x)
        assert all(torch.equal(model(x.narrow(0, i, 1)), full.narrow(0, i, 1)) for i in range(0, 300, 7))
        for start, rows in ((0, 64), (5, 100), (17, 3)):
            assert torch.equal(model(x.narrow(0, start, rows)), full.narrow(0, start, rows)), rows
        assert model(x.narrow(0, 0, 3)).shape == (3, 576)


def test_a_row_window_pads_and_splits_calls_to_measured_counts():
    window = batch_invariant.RowWindow(floor=3, cap=128)
    assert [window.call_rows(m) for m in (1, 3, 4, 64, 65, 100, 128)] == [3, 3, 4, 64, 128, 128, 128]
    assert window.counts() == [*range(3, 65), 128]
    calls = []

    def record(x):
        calls.append(x.shape[0])
        return x * 2

    x = torch.arange(300.0).unsqueeze(1)
    assert torch.equal(window.apply(record, x), x * 2)
    assert calls == [128, 128, 44]  # 300 = 128 + 128 + 44, and 44 runs as it is
    calls.clear()
    assert torch.equal(window.apply(record, x.narrow(0, 0, 2)), x.narrow(0, 0, 2) * 2) and calls == [3]
    calls.clear()
    assert torch.equal(window.apply(record, x.narrow(0, 0, 90)), x.narrow(0, 0, 90) * 2) and calls == [128]


def test_the_probe_finds_the_widest_window_that_agrees(monkeypatch):
    """A GEMM whose rows change bits at 150-256 rows (as oneDNN bf16 on an AMX Xeon) and below 4
    rows: the cap drops to 128, and the floor is 4."""
    def kinked(linear):  # element-wise (no summation order to vary), plus the kink
        return lambda x: x * 2 + (1e-3 if 150 <= x.shape[0] or x.shape[0] < 4 else 0.0)

    monkeypatch.setattr(batch_invariant, "_call", kinked)
    assert measure(64, 64, torch.float32, "cpu", False, 2, 1024) == batch_invariant.RowWindow(4, 128)



def test_a_gemm_that_depends_on_the_row_count_runs_at_one_count_and_one_on_the_position_is_refused(monkeypatch):
    def row_count_dependent(linear):
        return lambda x: x * 2 + x.shape[0] * 1e-3

    monkeypatch.setattr(batch_invariant, "_call", row_count_dependent)
    # No two counts agree: every call is padded to 64 rows, the most a floor may cost.
    assert measure(64, 64, torch.float32, "cpu", False, 2, 128) == batch_invariant.RowWindow(64, 64)

    def position_dependent(linear):
        return lambda x: x * 2 + torch.arange(x.shape[0], dtype=x.dtype).unsqueeze(1) * 1e-3

    monkeypatch.setattr(batch_invariant, "_call", position_dependent)
    with pytest.raises(NotBatchInvariantError, match=r"\[64, 64\] torch.float32 linear on cpu \(2 threads\) gives a "
                                                     r"row other bits at another position of a call of 128 rows"):
        measure(64, 64, torch.float32, "cpu", False, 2, 128)

    def floor_over_64(linear):  # counts below 100 disagree with the rest, and 2 rows with 1
        return lambda x: x * 2 + (1e-3 if x.shape[0] < 100 else 0.0) + (1e-3 if x.shape[0] == 2 else 0.0)

    monkeypatch.setattr(batch_invariant, "_call", floor_over_64)
    assert measure(64, 64, torch.float32, "cpu", False, 2, 1024) == batch_invariant.RowWindow(3, 64)


def test_the_default_bound_on_the_floor_refuses_before_wrapping(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False))
    floors = iter([2, 16])
    monkeypatch.setattr(batch_invariant, "probe", lambda *args: batch_invariant.RowWindow(next(floors), 256))
    with pytest.raises(NotBatchInvariantError, match="^1 would run every call of fewer than 16 rows padded to 16 rows "
                                                     r"\(more than 4\): deterministic inference would cost small "
                                                     "batches too much here$"):
        make_batch_invariant(model, max_floor=4)
    assert all(type(m) is torch.nn.Linear for m in model)  # nothing wrapped


def test_probe_results_persist_in_the_kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path))
    batch_invariant.probe.cache_clear()
    try:
        window = batch_invariant.probe(48, 40, torch.float32, "cpu", False, torch.get_num_threads(), 64)
        files = list((tmp_path / "kernels").glob("batch-invariance-*.json"))
        assert len(files) == 1
        known = json.loads(files[0].read_text())
        assert known[f"v2 48x40 torch.float32 packed=False threads={torch.get_num_threads()} rows=64"] == [
            window.floor, window.cap]
        batch_invariant.probe.cache_clear()
        monkeypatch.setattr(batch_invariant, "measure", lambda *a: pytest.fail("measured again"))
        assert batch_invariant.probe(48, 40, torch.float32, "cpu", False, torch.get_num_threads(), 64) == window
    finally:
        batch_invariant.probe.cache_clear()
