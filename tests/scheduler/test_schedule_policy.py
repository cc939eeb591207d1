"""Retraction under a deliberately tiny KV pool gives the greedy output of a roomy one. (The
policy's plans themselves, admission order included, are tested without a model in
test_policy_plans.py.)"""

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


def test_the_engine_plans_with_the_configured_policy(make_engine):
    engines = [make_engine(schedule_policy=p, chunked_prefill_size=c) for p, c in (("fcfs", 0), ("lpm", 64))]
    assert [(e.policy.policy, e.policy.chunked_prefill_size) for e in engines] == [("fcfs", 0), ("lpm", 64)]
    assert [e.load().schedule_policy for e in engines] == ["fcfs", "lpm"]  # reported to the tokenizer
