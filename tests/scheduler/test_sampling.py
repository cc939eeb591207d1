"""Sampling: seeds reproduce, seeds differ, filters and logprobs."""

from __future__ import annotations

import math

from services.scheduler.engine.req import ReqInput, SamplingParams


def sampled(rid, ids, seed=None, n=12, **kw):
    params = SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=seed, **kw)
    return ReqInput(rid=rid, input_ids=ids, sampling=params)


def test_seeded_sampling_reproducible_and_seed_sensitive(make_engine, chat_ids, run_all):
    prompt = chat_ids("Invent a name for a cat.")
    engine = make_engine()
    engine.add_request(sampled("a", prompt, seed=1234))
    engine.add_request(sampled("b", prompt, seed=1234))
    engine.add_request(sampled("c", prompt, seed=99))
    engine.add_request(sampled("d", prompt, top_p=0.9, top_k=50, min_p=0.05, seed=7))
    first = run_all(engine)
    again = make_engine()
    again.add_request(sampled("a", prompt, seed=1234))
    second = run_all(again)
    assert first["a"].output_ids == first["b"].output_ids == second["a"].output_ids
    assert first["a"].output_ids != first["c"].output_ids
    assert len(first["d"].output_ids) == 12


def test_top_k_one_is_greedy_and_logprobs(make_engine, chat_ids, greedy_req, run_all):
    prompt = chat_ids("Name a colour.")
    engine = make_engine()
    engine.add_request(sampled("k1", prompt, n=10, top_k=1))
    engine.add_request(greedy_req("g", prompt, 10, ignore_eos=True))
    engine.add_request(ReqInput(rid="lp", input_ids=prompt, return_logprob=True, top_logprobs_num=3,
                                sampling=SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)))
    res = run_all(engine)
    assert res["k1"].output_ids == res["g"].output_ids == res["lp"].output_ids
    lp = res["lp"]
    assert len(lp.logprobs) == 10 and len(lp.top_ids) == 30 and len(lp.top_vals) == 30
    for t in range(10):
        ids, vals = lp.top_ids[3 * t : 3 * t + 3], lp.top_vals[3 * t : 3 * t + 3]
        assert ids[0] == lp.output_ids[t]  # greedy: the chosen token is the most likely
        assert math.isclose(vals[0], lp.logprobs[t], abs_tol=1e-6) and vals == sorted(vals, reverse=True)
        assert lp.logprobs[t] <= 0.0
    assert res["g"].logprobs == []  # no logprob columns for rows that did not ask
