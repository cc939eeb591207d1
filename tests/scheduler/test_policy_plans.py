"""The scheduling policy's plans, step by step, on a small KV pool with a fake runner (no model):
admission (fcfs, lpm and its queue cut-off), token budgets, chunked prefill mixed with
decoding, retraction, prefix-cache reuse and eviction, release, and overlap's skip.

Each step is read as (rids, prefix_lens, extend_lens, num_extend, sampled): extend rows
first, then one decode row per running request. ``position_token`` samples 1000 + the
position a token takes, so outputs are known in advance.
"""

from __future__ import annotations

import pytest

from services.scheduler.policy.schedule import _LPM_MAX_QUEUE
from tests.helpers.fake_runner import FakeRunner, create_policy, make_req


def rows(record) -> tuple:
    return record.rids, record.prefix_lens, record.extend_lens, record.num_extend, record.sampled


def test_fcfs_admits_in_order_up_to_the_req_slots():
    policy = create_policy(kv_tokens=64, max_running=2)
    runner = FakeRunner(policy)
    runner.add(make_req("a", [1, 2, 3], 2), make_req("b", [4, 5, 6, 7], 2), make_req("c", [8, 9], 2))
    assert [rows(s) for s in runner.run()] == [
        (["a", "b"], [0, 0], [3, 4], 2, {"a": 1003, "b": 1004}),  # "c" waits: both slots taken
        (["a", "b"], [3, 4], [1, 1], 0, {"a": 1004, "b": 1005}),  # both end: their slots free
        (["c"], [0], [2], 1, {"c": 1002}),
        (["c"], [2], [1], 0, {"c": 1003}),
    ]
    assert runner.finished == {"a": [1003, 1004], "b": [1004, 1005], "c": [1002, 1003]}
    # Every computed token but each request's last stays cached: 4 + 5 + 3 rows, all evictable.
    assert (policy.req_pool.available, policy.kv_pool.used, policy.kv_cached,
            policy.tree.protected_size) == (2, 12, 12, 0)


def test_without_a_prefix_cache_release_frees_every_row():
    policy = create_policy(kv_tokens=16, radix=False)
    runner = FakeRunner(policy)
    runner.add(make_req("a", [1, 2, 3, 4, 5], 3))
    runner.run()
    assert runner.finished == {"a": [1005, 1006, 1007]}
    assert (policy.kv_pool.available, policy.req_pool.available, policy.kv_cached) == (16, 4, 0)


@pytest.mark.parametrize("order, first", [("fcfs", "cold"), ("lpm", "warm")])
def test_lpm_admits_the_longest_cached_prefix_first(order, first):
    system = [7, 7, 3, 9, 4, 2]
    policy = create_policy(max_running=1, policy=order)
    runner = FakeRunner(policy)
    runner.add(make_req("seed", system, 1))
    runner.run()
    assert policy.kv_cached == len(system)
    cold, warm = make_req("cold", [50, 51, 52], 2), make_req("warm", system + [60, 61], 2)
    runner.add(cold, warm)
    assert runner.step().rids == [first]
    runner.run()
    assert set(runner.finished) == {"seed", "cold", "warm"}
    assert (cold.cached_tokens, warm.cached_tokens) == (0, len(system))


@pytest.mark.parametrize("colds, first", [(_LPM_MAX_QUEUE - 1, "warm"), (_LPM_MAX_QUEUE, "cold0")])
def test_lpm_orders_first_come_first_served_beyond_its_queue_limit(colds, first):
    system = [7, 7, 3, 9]
    policy = create_policy(kv_tokens=32, max_running=1, policy="lpm")
    runner = FakeRunner(policy)
    runner.add(make_req("seed", system, 1))
    runner.run()
    runner.add(*(make_req(f"cold{i}", [50 + i], 1) for i in range(colds)), make_req("warm", system + [60], 1))
    assert runner.step().rids == [first]


def test_the_token_budget_holds_back_a_second_prompt_but_never_a_lone_one():
    policy = create_policy(max_prefill_tokens=8)
    runner = FakeRunner(policy)
    runner.add(make_req("a", [1, 2, 3, 4, 5], 2), make_req("b", [6, 7, 8, 9, 10], 2))
    assert rows(runner.step()) == (["a"], [0], [5], 1, {"a": 1005})  # 5 + 5 > 8: "b" waits
    assert rows(runner.step()) == (["b", "a"], [0, 5], [5, 1], 1, {"b": 1005, "a": 1006})
    runner.run()
    runner.add(make_req("long", list(range(21, 33)), 1))
    assert rows(runner.step()) == (["long"], [0], [12], 1, {"long": 1012})  # over the budget, alone, whole


def test_chunked_prefill_runs_beside_the_decodes_and_fills_the_budget():
    policy = create_policy(chunked_prefill_size=4)
    runner = FakeRunner(policy)
    runner.add(make_req("short", [1, 2, 3], 6))
    assert rows(runner.step()) == (["short"], [0], [3], 1, {"short": 1003})
    runner.add(make_req("long", list(range(10, 20)), 2), make_req("next", [30, 31, 32], 1))
    steps = [rows(runner.step()) for _ in range(4)]
    assert steps == [
        # "long" takes the step's 4 tokens; a chunk short of the prompt's end samples nothing.
        (["long", "short"], [0, 3], [4, 1], 1, {"short": 1004}),
        (["long", "short"], [4, 4], [4, 1], 1, {"short": 1005}),
        # The last 2 tokens of "long" leave 2 of the budget: "next" starts in them.
        (["long", "next", "short"], [8, 0, 5], [2, 2, 1], 2, {"long": 1010, "short": 1006}),
        (["next", "short", "long"], [2, 6, 10], [1, 1, 1], 1, {"next": 1003, "short": 1007, "long": 1011}),
    ]
    assert policy.chunked is None and runner.finished == {"next": [1003], "long": [1010, 1011]}


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
def test_retraction_takes_the_least_progress_and_resumes_with_the_same_tokens(radix):
    # Both prompts fit at admission, but not both sequences once they grow.
    policy = create_policy(kv_tokens=12, radix=radix)
    runner = FakeRunner(policy)
    runner.add(make_req("a", [1, 2, 3], 6), make_req("b", [4, 5, 6], 6))
    steps = [rows(s) for s in runner.run()]
    assert policy.num_retracted == 1
    assert steps[:5] == [
        (["a", "b"], [0, 0], [3, 3], 2, {"a": 1003, "b": 1003}),
        (["a", "b"], [3, 3], [1, 1], 0, {"a": 1004, "b": 1004}),
        (["a", "b"], [4, 4], [1, 1], 0, {"a": 1005, "b": 1005}),
        (["a", "b"], [5, 5], [1, 1], 0, {"a": 1006, "b": 1006}),  # the pool is full
        # Equal progress: the newest, "b", is retracted; nothing is admitted in that step.
        (["a"], [6], [1], 0, {"a": 1007}),
    ]
    # "b" waits until "a" ends, then prefills its prompt and its 4 outputs again.
    assert steps[5:] == [
        (["a"], [7], [1], 0, {"a": 1008}),
        (["b"], [0], [7], 1, {"b": 1007}),
        (["b"], [7], [1], 0, {"b": 1008}),
    ]
    assert runner.finished == {"a": list(range(1003, 1009)), "b": list(range(1003, 1009))}
    assert policy.req_pool.available == 4 and policy.kv_pool.used == policy.kv_cached


def test_a_chunked_prefill_is_retracted_before_any_running_request():
    policy = create_policy(kv_tokens=20, chunked_prefill_size=4, radix=False)
    runner = FakeRunner(policy)
    runner.add(make_req("a", [1, 2, 3], 20))
    runner.step()
    runner.add(make_req("b", [4, 5, 6], 20))
    runner.step()
    long = make_req("long", list(range(10, 20)), 1)
    runner.add(long)
    # 13 rows are left: the 10 of "long", a decode row each for "a" and "b", and its first.
    assert rows(runner.step()) == (["long", "a", "b"], [0, 4, 3], [4, 1, 1], 1, {"a": 1005, "b": 1004})
    assert rows(runner.step()) == (["long", "a", "b"], [4, 5, 4], [4, 1, 1], 1, {"a": 1006, "b": 1005})
    # One row is left for three: "long", mid-prefill, goes back first and frees its 8.
    assert policy.kv_room == 1
    assert rows(runner.step()) == (["a", "b"], [6, 5], [1, 1], 0, {"a": 1007, "b": 1006})
    assert policy.num_retracted == 1 and list(policy.waiting) == [long] and policy.chunked is None
    assert (long.req_slot, long.kv_len, policy.kv_room) == (None, 0, 7)


def test_a_repeated_prompt_reuses_all_but_its_last_token():
    prompt = [5, 6, 7, 8, 9]
    policy = create_policy()
    runner = FakeRunner(policy)
    first = make_req("first", prompt, 3)
    runner.add(first)
    runner.run()
    # The prompt and 2 of the 3 outputs have K/V (the last output's is never computed).
    assert (policy.kv_cached, policy.kv_pool.used) == (len(prompt) + 2, len(prompt) + 2)
    again = make_req("again", prompt, 3)
    runner.add(again)
    # The last prompt token is recomputed: its logits pick the first output.
    assert rows(runner.step()) == (["again"], [4], [1], 1, {"again": 1005})
    assert (first.cached_tokens, again.cached_tokens) == (0, 4)
    assert policy.tree.protected_size == 4  # the prefix "again" reads is locked while it runs
    runner.run()
    assert runner.finished["again"] == runner.finished["first"] and policy.tree.protected_size == 0


def test_abort_mid_prefill_caches_the_chunks_done():
    prompt = list(range(10, 20))
    policy = create_policy(chunked_prefill_size=4)
    runner = FakeRunner(policy)
    long = make_req("long", prompt, 3)
    runner.add(long)
    runner.step()
    runner.step()
    assert policy.chunked is long and long.kv_len == 8
    policy.remove(long)
    assert (policy.chunked, policy.req_pool.available, policy.kv_cached, policy.kv_pool.used) == (None, 4, 8, 8)
    again = make_req("again", prompt, 3)
    runner.add(again)
    assert rows(runner.step()) == (["again"], [8], [2], 1, {"again": 1010})
    assert again.cached_tokens == 8


def test_remove_releases_a_waiting_a_running_and_an_unknown_request_alike():
    policy = create_policy(max_running=1, radix=False)
    runner = FakeRunner(policy)
    running, waiting = make_req("running", [1, 2, 3], 5), make_req("waiting", [4, 5], 5)
    runner.add(running, waiting)
    runner.step()
    assert (policy.running, list(policy.waiting), policy.kv_pool.used) == ([running], [waiting], 3)
    policy.remove(waiting)
    policy.remove(running)
    policy.remove(make_req("never-queued", [6], 1))
    assert (policy.running, list(policy.waiting), policy.kv_pool.used, policy.req_pool.available) == ([], [], 0, 1)
    assert runner.step() is None


def test_a_tiny_pool_evicts_cached_prefixes_least_recently_used_first():
    policy = create_policy(kv_tokens=10)
    runner = FakeRunner(policy)
    for i in range(3):  # each leaves 4 rows cached; the third needs the first's
        runner.add(make_req(f"p{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3], 2))
        runner.run()
    assert set(runner.finished) == {"p0", "p1", "p2"} and policy.kv_cached == policy.kv_pool.used == 8
    assert policy.tree.match_prefix([1, 2, 3])[0].numel() == 0  # p0, the oldest, was evicted
    assert policy.tree.match_prefix([11, 12, 13])[0].numel() == 3


def test_a_prompt_waits_until_the_pool_holds_it_and_a_row_per_running_request():
    policy = create_policy(kv_tokens=10, radix=False)
    runner = FakeRunner(policy)
    runner.add(make_req("a", [1, 2, 3, 4], 2), make_req("b", [5, 6, 7, 8], 4))
    # After "a", 6 rows are left: the 4 of "b", "a"'s next token and the first of "b".
    assert runner.step().rids == ["a", "b"]
    runner.add(make_req("c", [9], 1))
    assert runner.step().rids == ["a", "b"]  # "c" needs 1 + 2 + 1 rows, and 2 are left; "a" ends
    assert rows(runner.step()) == (["c", "b"], [0, 5], [1, 1], 1, {"c": 1001, "b": 1006})


def test_skip_leaves_a_running_request_out_of_the_decode_rows():
    policy = create_policy()
    runner = FakeRunner(policy)
    a, b = make_req("a", [1, 2], 5), make_req("b", [3, 4], 5)
    runner.add(a, b)
    runner.step()
    assert rows(runner.step(skip=frozenset({a}))) == (["b"], [2], [1], 0, {"b": 1003})
    assert policy.running == [a, b]


def test_reset_forgets_every_request_and_rebuilds_the_pools():
    policy = create_policy(chunked_prefill_size=2)
    runner = FakeRunner(policy)
    runner.add(make_req("a", [1, 2, 3, 4, 5], 2), make_req("b", [6], 1))
    runner.step()
    policy.reset()
    assert (policy.running, list(policy.waiting), policy.chunked) == ([], [], None)
    assert (policy.kv_pool.available, policy.req_pool.available, policy.kv_cached) == (64, 4, 0)
    assert runner.step() is None


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match=r"^unknown schedule policy 'lifo'; supported: \('fcfs', 'lpm', 'priority'\)$"):
        create_policy(policy="lifo")
