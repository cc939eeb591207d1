"""Chunked prefill mixed with decoding: a long prompt is prefilled a chunk per step while
running requests keep getting a token every step, and its output equals an unchunked run."""

from __future__ import annotations

import math

from tests.helpers.engine_steps import collect

LONG = "Summarize the following notes. " + " ".join(f"Note {i}: the {i}th lamp was lit at dusk." for i in range(30))


def test_chunked_output_equals_unchunked(make_engine, chat_ids, greedy_req, run_all):
    prompt = chat_ids(LONG)
    assert len(prompt) > 4 * 64
    outputs = {}
    for chunk in (64, 0):
        engine = make_engine(chunked_prefill_size=chunk, disable_radix_cache=True)
        engine.add_request(greedy_req("long", prompt, 8, ignore_eos=True))
        res = run_all(engine)["long"]
        # One step per chunk, the last of which samples the first token, then 7 decode steps.
        assert res.init_rows == [math.ceil(len(prompt) / chunk) - 1 if chunk else 0]
        outputs[chunk] = res.output_ids
        assert engine.load().kv_used_tokens == 0
    assert outputs[64] == outputs[0]


def test_running_stream_gets_a_token_every_step_while_a_long_prompt_prefills(make_engine, chat_ids, greedy_req,
                                                                            run_all):
    engine = make_engine(chunked_prefill_size=64)
    engine.add_request(greedy_req("short", chat_ids("Count slowly."), 20, ignore_eos=True))
    results = run_all(engine, {}, max_steps=1)  # "short" is prefilled and decoding
    prompt = chat_ids(LONG)
    engine.add_request(greedy_req("long", prompt, 4, ignore_eos=True))
    chunks = math.ceil(len(prompt) / 64)
    steps = []
    for step in range(chunks):
        out = engine.step()
        collect(out, results, step)
        steps.append(list(out.rids))
        assert engine.load().num_running_reqs == 2
    # Every step carries a token for "short"; "long" gets its first token with its last chunk.
    assert steps == [["short"]] * (chunks - 1) + [["long", "short"]]
    assert results["short"].completion_tokens == 1 + chunks
    run_all(engine, results)
    solo = make_engine()
    solo.add_request(greedy_req("short", chat_ids("Count slowly."), 20, ignore_eos=True))
    assert run_all(solo)["short"].output_ids == results["short"].output_ids
    assert len(results["long"].output_ids) == 4 and engine.load().kv_used_tokens == 0


def test_abort_mid_prefill_caches_the_chunks_done(make_engine, chat_ids, greedy_req, run_all):
    prompt = chat_ids(LONG)
    engine = make_engine(chunked_prefill_size=64)
    engine.add_request(greedy_req("long", prompt, 3, ignore_eos=True))
    results = run_all(engine, {}, max_steps=2)
    assert "long" not in results and engine.load().num_running_reqs == 1
    engine.abort(rid="long")
    run_all(engine, results)
    load = engine.load()
    assert results["long"].output_ids == [] and results["long"].finish.status == "CANCELLED"
    assert (load.kv_used_tokens, load.req_slots_used, load.kv_cached_tokens) == (0, 0, 128)
    # The two chunks computed before the abort are reused: only the rest is prefilled.
    engine.add_request(greedy_req("again", prompt, 3, ignore_eos=True))
    again = run_all(engine)["again"]
    plain = make_engine(disable_radix_cache=True)
    plain.add_request(greedy_req("plain", prompt, 3, ignore_eos=True))
    assert again.cached_tokens == 128 and again.output_ids == run_all(plain)["plain"].output_ids
