"""The request's priority in the tokenizer: copied to every choice's scheduler request, and a
non-zero one refused before dispatch when the chosen scheduler reports a policy that cannot
honour it (its LoadReport's schedule_policy)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ringserve.v1 import common_pb2, tokenizer_pb2
from services.tokenizer.errors import RequestError
from services.tokenizer.links import SchedulerLink


def req(rid: str, priority: int, n: int = 1) -> tokenizer_pb2.GenerateReqInput:
    return tokenizer_pb2.GenerateReqInput(rid=rid, text="Hello", priority=priority,
                                          sampling_params=common_pb2.SamplingParams(n=n))


def test_every_choice_carries_the_priority(manager):
    assert [s.priority for s in manager.prepare(req("p", -5, n=2)).subs] == [-5, -5]
    assert manager.prepare(req("q", 0)).subs[0].priority == 0


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
async def test_a_priority_the_scheduler_cannot_honour_is_refused_before_dispatch(manager, dispatcher, policy):
    dispatcher.schedule_policy = policy
    with pytest.raises(RequestError) as info:
        await anext(manager.generate(req("p", 1)))
    err = info.value
    assert (err.status, err.code, err.param, err.message) == (
        grpc.StatusCode.INVALID_ARGUMENT, "invalid_value", "priority",
        f"priority must be 0 under --schedule-policy {policy}: the scheduler orders requests by priority only "
        "when started with --schedule-policy priority")
    assert dispatcher.reqs == [] and manager.rid_to_state == {}


@pytest.mark.parametrize("policy, priority", [("priority", -1), ("fcfs", 0), (None, 3)])
async def test_a_priority_is_dispatched_where_it_can_be_honoured_or_the_policy_is_not_known_yet(
        manager, dispatcher, policy, priority):
    # With no LoadReport yet (None) the scheduler's own validation decides.
    dispatcher.schedule_policy = policy
    gen = manager.generate(req("p", priority))
    task = asyncio.ensure_future(anext(gen))
    for _ in range(5):
        await asyncio.sleep(0)
    assert [(r.rid, r.priority) for r in dispatcher.reqs] == [("p", priority)]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await gen.aclose()


def test_the_scheduler_link_reads_the_policy_from_the_latest_load_report():
    link = SchedulerLink("127.0.0.1:1", "tok", lambda link, up: None)
    assert link.schedule_policy is None
    link.last_load = common_pb2.LoadReport(schedule_policy="priority")
    assert link.schedule_policy == "priority"
    link.last_load = common_pb2.LoadReport()  # a scheduler that does not report it
    assert link.schedule_policy is None
