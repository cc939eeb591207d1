"""N-gram speculative decoding in the engine: the same greedy tokens and logprobs as without
it, bit for bit under deterministic inference (SmolLM2 fp32, cpu attention backend), across
64 concurrent requests with stop strings, stop ids, max_tokens and top logprobs, prefilled in
chunks; prefix-cache hits; retraction under a small KV pool; seeds that reproduce; a
constrained request; an abort mid-run. After each run the KV pool is back to its baseline:
no rejected draft's row is leaked."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from services.scheduler.engine.engine import Engine
from services.scheduler.models import load_model
from services.scheduler.policy.grammar_backends import GrammarSpec
from services.scheduler.policy.req import FinishType, ReqInput, SamplingParams
from tests.helpers.engine_steps import Result, collect

NEW_TOKENS = 12
TEXTS = ["def area(w, h):\n    return w * h\n", "The red fox ran over the hill and the red fox slept.",
         '{"name": "Ada", "age": 36, "city": "London"}', "one, two, three, four, five, six",
         "Rain falls on the quiet town."]


@pytest.fixture(scope="module")
def spec_engine(smollm2_dir, tokenizer, make_engine):
    """Factory of deterministic fp32 engines on their own model (deterministic inference pads
    some linears in place); ``speculative_algorithm`` as given."""
    model = load_model(smollm2_dir, torch.float32, attention_backend="cpu")
    base = make_engine()

    def make(**overrides) -> Engine:
        settings = dict(max_running_requests=64, max_total_tokens=8192, deterministic_inference=True,
                        attention_backend="cpu")
        cfg = replace(base.cfg, **{**settings, **overrides})
        return Engine(model, tokenizer, base.stops.eos_ids, cfg)

    return make


def _requests(chat_ids, tokenizer) -> list[ReqInput]:
    stop_ids = frozenset(tokenizer.token_to_id(t) for t in (".", ",", "Ċ"))
    out = []
    for i in range(64):
        text = TEXTS[i % 5]
        ask = "Repeat exactly" if i % 2 == 0 else "Say something about"
        kw: dict = dict(temperature=0.0, max_new_tokens=NEW_TOKENS)
        if i % 4 == 1:
            kw["stop"] = (" the", "\n\n")  # a stop string inside an accepted run cuts it there
        elif i % 4 == 2:
            kw["stop_token_ids"] = stop_ids
        elif i % 4 == 3:
            kw["max_new_tokens"] = 3 + i % 7
        out.append(ReqInput(rid=f"p{i}", input_ids=chat_ids(f"{ask} ({i}): {text}"), return_logprob=True,
                            top_logprobs_num=2 if i % 3 == 0 else 0, sampling=SamplingParams(**kw)))
    return out


def _run(engine: Engine, requests: list[ReqInput], abort: str | None = None) -> dict[str, Result]:
    for req in requests:
        engine.add_request(req)
    results: dict[str, Result] = {}
    steps = 0
    while engine.has_work:
        out = engine.step()
        steps += 1
        if out is not None:
            collect(out, results)
        if abort is not None and steps == 4:
            engine.abort(abort)
    load = engine.load()
    assert (load.req_slots_used, load.kv_used_tokens) == (0, 0)
    assert load.kv_cached_tokens + engine.kv_pool.available == engine.kv_pool.size
    return results


def _same(got: dict[str, Result], want: dict[str, Result]) -> None:
    for rid, w in want.items():
        g = got[rid]
        assert (g.output_ids, g.logprobs, g.top_ids, g.top_vals, g.finish) == \
            (w.output_ids, w.logprobs, w.top_ids, w.top_vals, w.finish), rid


@pytest.fixture(scope="module")
def reference(spec_engine, chat_ids, tokenizer):
    return _run(spec_engine(), _requests(chat_ids, tokenizer))


def test_greedy_equals_non_speculative_in_a_concurrent_batch_and_from_the_cache(spec_engine, reference, chat_ids,
                                                                                tokenizer):
    # Chunks of 64 tokens: a prompt split over two steps beside the drafted rows' verification.
    engine = spec_engine(speculative_algorithm="ngram", chunked_prefill_size=64)
    requests = _requests(chat_ids, tokenizer)
    stop_ids = requests[2].sampling.stop_token_ids
    got = _run(engine, requests)
    _same(got, reference)
    stats = engine.speculator.stats
    assert stats.accepted > 50 and stats.proposed > stats.accepted
    finishes = {r.finish.type for r in got.values()}
    assert finishes == {FinishType.STOP, FinishType.LENGTH}
    assert any(r.finish.matched_str for r in got.values())
    assert any(r.finish.matched_token_id in stop_ids for r in got.values())
    again = _run(engine, requests[:8])  # their prompts and outputs now come from the prefix cache
    _same(again, {r.rid: reference[r.rid] for r in requests[:8]})
    assert all(again[r.rid].cached_tokens > 0 for r in requests[:8])


def test_retraction(spec_engine, reference, chat_ids, tokenizer):
    requests = [r for r in _requests(chat_ids, tokenizer) if len(reference[r.rid].output_ids) == NEW_TOKENS][:6]
    # Their prompts fit at admission, not their outputs: retraction.
    size = sum(len(r.input_ids) for r in requests) + 16
    engine = spec_engine(speculative_algorithm="ngram", chunked_prefill_size=0, max_total_tokens=size,
                         disable_radix_cache=True)
    _same(_run(engine, requests), {r.rid: reference[r.rid] for r in requests})
    assert engine.policy.num_retracted > 0 and engine.speculator.stats.accepted > 0


def test_seeded_sampling_reproduces(spec_engine, chat_ids, tokenizer):
    def seeded(i: int) -> ReqInput:
        return ReqInput(rid=f"s{i}", input_ids=chat_ids(f"Repeat exactly: {TEXTS[i]}"),
                        sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_new_tokens=16,
                                                ignore_eos=True))

    engine = spec_engine(speculative_algorithm="ngram")
    alone = _run(engine, [seeded(0)])
    together = _run(engine, [seeded(i) for i in range(3)])
    assert alone["s0"].output_ids == together["s0"].output_ids and len(alone["s0"].output_ids) == 16
    assert engine.speculator.stats.accepted > 0


def test_grammar_and_abort_under_speculation(spec_engine, reference, chat_ids, tokenizer):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}

    def constrained(rid: str) -> ReqInput:
        return ReqInput(rid=rid, input_ids=chat_ids(f"Repeat exactly: {TEXTS[2]}"), return_logprob=True,
                        grammar=GrammarSpec("json_schema", json.dumps(schema)),
                        sampling=SamplingParams(temperature=0.0, max_new_tokens=40))

    want = _run(spec_engine(), [constrained("g")])["g"]
    engine = spec_engine(speculative_algorithm="ngram")
    requests = _requests(chat_ids, tokenizer)[:6]
    got = _run(engine, [constrained("g"), *requests], abort="p2")
    # Drafts checked against the grammar, its matcher rolled back and advanced over the kept run.
    assert got["g"].output_ids == want.output_ids and got["g"].logprobs == want.logprobs
    assert got["g"].finish.type == FinishType.STOP
    assert json.loads(tokenizer.decode(got["g"].output_ids)) == {"name": "Ada", "age": 36}
    assert got["p2"].finish.type == FinishType.ABORT
    _same(got, {r.rid: reference[r.rid] for r in requests if r.rid != "p2"})
    alone = spec_engine(speculative_algorithm="ngram")
    assert _run(alone, [constrained("g")])["g"].output_ids == want.output_ids
    assert alone.speculator.stats.accepted > 5


def test_draft_model_on_the_same_verification(spec_engine, reference, chat_ids, tokenizer, smollm2_dir):
    # The served model as its own draft (transformers' forward, its own KV cache): most drafts
    # are accepted, and the output is still exactly the target's.
    engine = spec_engine(speculative_algorithm="draft", speculative_draft_model=smollm2_dir)
    requests = _requests(chat_ids, tokenizer)[1:3]  # a stop string, stop ids
    _same(_run(engine, requests), {r.rid: reference[r.rid] for r in requests})
    stats = engine.speculator.stats
    assert stats.accepted > 0.8 * stats.proposed > 0
    assert not engine.speculator.proposer._state  # every request's draft cache released
