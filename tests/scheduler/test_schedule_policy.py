"""Retraction under a deliberately tiny KV pool, and the longest-prefix-match admission order."""

from __future__ import annotations

import pytest

WORDS = ["ten", "twenty", "thirty", "forty"]


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
def test_retracted_requests_resume_with_identical_greedy_output(make_engine, chat_ids, greedy_req, run_all, radix):
    prompts = {f"r{i}": chat_ids(f"Count to {w}.") for i, w in enumerate(WORDS)}
    reqs = [greedy_req(rid, ids, 16, ignore_eos=True) for rid, ids in prompts.items()]
    roomy = make_engine(disable_radix_cache=not radix)
    for r in reqs:
        roomy.add_request(r)
    want = {rid: res.output_ids for rid, res in run_all(roomy).items()}
    assert roomy.policy.num_retracted == 0

    # All four prompts fit at admission, but not all four finished sequences at once.
    size = sum(len(p) for p in prompts.values()) + 16
    tiny = make_engine(max_total_tokens=size, disable_radix_cache=not radix)
    for r in reqs:
        tiny.add_request(r)
    got = run_all(tiny)
    assert tiny.policy.num_retracted > 0
    assert {rid: res.output_ids for rid, res in got.items()} == want
    assert all(res.completion_tokens == 16 for res in got.values())
    load = tiny.load()
    assert (load.kv_used_tokens, load.req_slots_used, load.num_waiting_reqs) == (0, 0, 0)


def test_lpm_admits_the_longest_cached_prefix_first(make_engine, chat_ids, greedy_req, run_all):
    system = chat_ids("You are a helpful assistant who answers briefly.")
    for policy, first in (("fcfs", "cold"), ("lpm", "warm")):
        engine = make_engine(max_running_requests=1, schedule_policy=policy)
        engine.add_request(greedy_req("seed", system, 1))
        run_all(engine)
        engine.add_request(greedy_req("cold", chat_ids("What is rain?"), 2))
        engine.add_request(greedy_req("warm", system + chat_ids("What is snow?"), 2))
        assert engine.step().rids == [first]
        results = run_all(engine)
        assert results["warm"].cached_tokens >= len(system)
