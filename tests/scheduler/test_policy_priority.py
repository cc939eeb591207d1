"""The priority policy's plans on a small KV pool with the fake runner (no model): the waiting
queue ordered by (priority, arrival), retraction of the lowest priority under KV pressure, a
retracted request back in its priority place, and preemption for a higher-priority prompt.

``position_token`` samples 1000 + the position a token takes, so a request's output is known
in advance and a retracted request must resume with the tokens it would have had alone.
"""

from __future__ import annotations

import logging

import pytest

from ringserve.v1 import scheduler_pb2
from services.scheduler.engine.step_state import LoadStats
from services.scheduler.wire import load_to_proto, req_input_from_proto
from tests.helpers.fake_runner import FakeRunner, create_policy, make_req


def rows(record) -> tuple:
    return record.rids, record.prefix_lens, record.extend_lens, record.num_extend, record.sampled


def admitted(runner: FakeRunner) -> list[str]:
    """The rids of every admission (an extend row, without chunking), in order."""
    return [rid for step in runner.steps for rid in step.rids[: step.num_extend]]


def alone(prompt_len: int, max_new_tokens: int) -> list[int]:
    """What ``position_token`` gives a request run alone."""
    return list(range(1000 + prompt_len, 1000 + prompt_len + max_new_tokens))


@pytest.mark.parametrize("order, want", [("priority", ["c", "e", "a", "d", "b"]), ("fcfs", ["a", "b", "c", "d", "e"])])
def test_the_queue_is_ordered_by_priority_then_arrival(order, want):
    policy = create_policy(policy=order)
    for rid, priority in (("a", 0), ("b", 1), ("c", -1), ("d", 0), ("e", -1)):
        policy.waiting.append(make_req(rid, [1, 2], priority=priority))
    assert [r.rid for r in policy.waiting] == want
    assert [r.arrival for r in policy.waiting] == [ord(rid) - ord("a") for rid in want]


@pytest.mark.parametrize("order, want", [
    ("priority", ["first", "urgent", *(f"z{i}" for i in range(8))]),
    ("fcfs", ["first", *(f"z{i}" for i in range(8)), "urgent"]),
])
def test_a_priority_minus_one_request_after_many_zero_ones_takes_the_next_free_slot(order, want):
    policy = create_policy(kv_tokens=64, max_running=1, policy=order)
    runner = FakeRunner(policy)
    runner.add(make_req("first", [1, 2], 3))
    runner.step()
    runner.add(*(make_req(f"z{i}", [10 + i], 1) for i in range(8)), make_req("urgent", [30, 31], 1, priority=-1))
    # A full batch of request slots is not preempted: "urgent" waits for "first" to end.
    assert rows(runner.step()) == (["first"], [2], [1], 0, {"first": 1003})
    runner.run()
    assert admitted(runner) == want
    assert policy.num_retracted == 0


@pytest.mark.parametrize("order, victim", [("priority", "low"), ("fcfs", "high")])
def test_under_kv_pressure_the_lowest_priority_request_is_retracted(order, victim, caplog):
    # "low" started a step earlier: the least-progress rule alone would retract "high".
    policy = create_policy(kv_tokens=12, policy=order)
    runner = FakeRunner(policy)
    low, high = make_req("low", [1, 2, 3], 8, priority=1), make_req("high", [4, 5, 6], 8)
    runner.add(low)
    runner.step()
    runner.add(high)
    with caplog.at_level(logging.INFO, logger="services.scheduler.policy.schedule"):
        steps = [rows(s) for s in runner.run()]
    survivor = "high" if victim == "low" else "low"
    assert steps[:3] == [
        (["high", "low"], [0, 3], [3, 1], 1, {"high": 1003, "low": 1004}),
        (["low", "high"], [4, 3], [1, 1], 0, {"low": 1005, "high": 1004}),
        (["low", "high"], [5, 4], [1, 1], 0, {"low": 1006, "high": 1005}),  # the pool is full
    ]
    assert steps[3][0] == [survivor] and policy.num_retracted == 1
    outputs = {"low": 4, "high": 3}[victim]
    assert [r.getMessage() for r in caplog.records] == [
        f"retracted request {victim} (priority {1 if victim == 'low' else 0}, {outputs} output tokens) "
        "for KV room for the running requests' next tokens"]
    # The victim resumes after the survivor ends, with the tokens it would have had alone.
    assert admitted(runner) == ["low", "high", victim]
    assert runner.finished == {"low": alone(3, 8), "high": alone(3, 8)}


def test_a_retracted_request_goes_back_to_its_priority_place():
    policy = create_policy(kv_tokens=12, max_running=2, policy="priority")
    runner = FakeRunner(policy)
    runner.add(make_req("low", [1, 2, 3], 8, priority=1))
    runner.step()
    runner.add(make_req("high", [4, 5, 6], 8))
    runner.step()
    # Both request slots are taken: these wait, ordered by priority.
    runner.add(make_req("later1", [7], 1, priority=1), make_req("last", [8], 1, priority=2),
               make_req("zero", [9], 1, priority=0))
    assert [r.rid for r in policy.waiting] == ["zero", "later1", "last"]
    while not policy.num_retracted:
        runner.step()
    # "low" keeps its arrival: before "later1" of its own priority, after "zero".
    assert [r.rid for r in policy.waiting] == ["zero", "low", "later1", "last"]
    runner.run()
    assert admitted(runner) == ["low", "high", "zero", "low", "later1", "last"]
    assert runner.finished["low"] == alone(3, 8)


def test_a_chunked_prefill_is_retracted_only_among_its_own_priority():
    policy = create_policy(kv_tokens=20, chunked_prefill_size=4, radix=False, policy="priority")
    runner = FakeRunner(policy)
    runner.add(make_req("a", [1, 2, 3], 20, priority=1))
    runner.step()
    runner.add(make_req("b", [4, 5, 6], 20))
    runner.step()
    runner.add(make_req("long", list(range(10, 20)), 1))
    runner.step()
    runner.step()
    assert policy.kv_room == 1 and policy.chunked.rid == "long"
    # Three rows are needed and one is left: "a" (priority 1) goes first, and its 5 rows are enough.
    assert rows(runner.step()) == (["long", "b"], [8, 5], [2, 1], 1, {"long": 1010, "b": 1006})
    assert [r.rid for r in policy.waiting] == ["a"] and policy.num_retracted == 1


@pytest.mark.parametrize("urgent_priority", [0, 1])
def test_a_higher_priority_prompt_that_does_not_fit_preempts_a_lower_one(urgent_priority, caplog):
    policy = create_policy(kv_tokens=16, policy="priority")
    runner = FakeRunner(policy)
    runner.add(make_req("bg", [1, 2, 3, 4, 5, 6], 8, priority=1))
    for _ in range(3):
        runner.step()
    # "bg" holds 8 of the 16 rows: the 8 of "urgent", a decode row for "bg" and its first need 10.
    runner.add(make_req("urgent", list(range(20, 28)), 2, priority=urgent_priority))
    with caplog.at_level(logging.INFO, logger="services.scheduler.policy.schedule"):
        first = rows(runner.step())
    if urgent_priority == 0:
        assert first == (["urgent"], [0], [8], 1, {"urgent": 1008})
        assert [r.getMessage() for r in caplog.records] == [
            "retracted request bg (priority 1, 3 output tokens) for request urgent of priority 0"]
        assert admitted(runner) == ["bg", "urgent"] and [r.rid for r in policy.waiting] == ["bg"]
    else:  # an equal priority never preempts: "urgent" waits for "bg" to end
        assert first == (["bg"], [8], [1], 0, {"bg": 1009})
        assert caplog.records == []
    runner.run()
    assert policy.num_retracted == (1 if urgent_priority == 0 else 0)
    assert runner.finished == {"bg": alone(6, 8), "urgent": alone(8, 2)}


def test_no_request_is_preempted_when_retracting_every_lower_one_would_not_make_room():
    policy = create_policy(kv_tokens=20, radix=False, policy="priority")
    runner = FakeRunner(policy)
    runner.add(make_req("top", list(range(1, 11)), 8, priority=-1), make_req("small", [11, 12], 8, priority=1))
    runner.step()
    # "top" holds 10 rows and "small" 2; "urgent" needs 9 + 2 decode rows + 1 = 12 > 8 free, and
    # retracting "small" would leave at best 10 free for 9 + 1 + 1 = 11.
    runner.add(make_req("urgent", list(range(30, 39)), 1, priority=0))
    assert rows(runner.step()) == (["top", "small"], [10, 2], [1, 1], 0, {"top": 1011, "small": 1003})
    assert policy.num_retracted == 0 and [r.rid for r in policy.waiting] == ["urgent"]


def test_the_wire_carries_the_priority_in_and_the_policy_out():
    msg = scheduler_pb2.TokenizedGenerateReqInput(rid="r", input_ids=[1, 2], priority=-3)
    assert req_input_from_proto(msg, "tok").priority == -3
    stats = LoadStats(*[0] * 10, schedule_policy="priority")
    assert load_to_proto(stats, "sched").schedule_policy == "priority"
