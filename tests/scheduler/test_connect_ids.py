"""Scheduler.Connect's tokenizer ids, without a network: a second hello for a connected id is
refused and, when it leaves, aborts nothing of the owner's; a stream's aborts reach only its
own tokenizer's requests (servicer against a recording loop; the engine's rid scoping on the
real engine)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ringserve.v1 import scheduler_pb2
from services.scheduler.engine.step_state import LoadStats
from services.scheduler.policy.req import ReqInput, SamplingParams
from services.scheduler.servicer import SchedulerServicer


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, details)
        self.code, self.details = code, details


class FakeContext:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class RecordingLoop:
    """The EngineLoop calls the servicer makes, recorded."""

    def __init__(self) -> None:
        self.submitted: list[ReqInput] = []
        self.aborts: list[dict] = []

    def submit(self, spec: ReqInput) -> None:
        self.submitted.append(spec)

    def abort(self, rid=None, tokenizer_id=None, **_kw) -> None:
        self.aborts.append({"rid": rid, "tokenizer_id": tokenizer_id})

    def load(self) -> LoadStats:
        return LoadStats(*[0] * 10)


def hello(tokenizer_id: str) -> scheduler_pb2.SchedulerInput:
    return scheduler_pb2.SchedulerInput(abort=scheduler_pb2.AbortReq(tokenizer_id=tokenizer_id))


def abort(**fields) -> scheduler_pb2.SchedulerInput:
    return scheduler_pb2.SchedulerInput(abort=scheduler_pb2.AbortReq(**fields))


class Stream:
    """One Connect call fed from a queue (None ends the client's side)."""

    def __init__(self, servicer: SchedulerServicer, first: scheduler_pb2.SchedulerInput) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queue.put_nowait(first)
        self.call = servicer.Connect(self._messages(), FakeContext())

    async def _messages(self):
        while (msg := await self.queue.get()) is not None:
            yield msg

    async def next(self):
        return await asyncio.wait_for(anext(self.call), 1)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_second_hello_for_a_connected_id_is_refused() -> None:
    loop = RecordingLoop()
    servicer = SchedulerServicer(loop, "sched-test", load_report_interval_s=60)
    owner = Stream(servicer, hello("tok-a"))
    assert (await owner.next()).HasField("load")
    assert servicer.connected == {"tok-a"}

    intruder = Stream(servicer, hello("tok-a"))
    with pytest.raises(Aborted) as info:
        await intruder.next()
    assert (info.value.code, info.value.details) == (
        grpc.StatusCode.ALREADY_EXISTS, "tokenizer 'tok-a' is already connected on another stream")
    await settle()
    assert loop.aborts == []  # its leaving aborted nothing of the owner's
    assert servicer.connected == {"tok-a"}

    owner.queue.put_nowait(None)  # the owner's stream ends: its requests are aborted, the id is free
    with pytest.raises(StopAsyncIteration):
        await owner.next()
    assert loop.aborts == [{"rid": None, "tokenizer_id": "tok-a"}] and servicer.connected == set()
    again = Stream(servicer, hello("tok-a"))
    assert (await again.next()).HasField("load")
    await again.call.aclose()


async def test_a_stream_aborts_only_its_own_requests() -> None:
    loop = RecordingLoop()
    servicer = SchedulerServicer(loop, "sched-test", load_report_interval_s=60)
    other = Stream(servicer, hello("tok-b"))
    await other.next()
    for msg in (abort(abort_all=True, tokenizer_id="tok-a"), abort(rid="r-a", tokenizer_id="tok-a"),
                abort(rid="r-a"), abort(abort_all=True)):
        other.queue.put_nowait(msg)
    await settle()
    # Those naming tok-a are ignored; the rest are scoped to tok-b (the engine aborts a rid only for its owner).
    assert loop.aborts == [{"rid": "r-a", "tokenizer_id": "tok-b"}, {"rid": None, "tokenizer_id": "tok-b"}]
    await other.call.aclose()


def test_engine_aborts_a_rid_only_for_its_owner(make_engine) -> None:
    engine = make_engine()
    params = SamplingParams(temperature=0.0, max_new_tokens=4)
    engine.add_request(ReqInput(rid="r-a", input_ids=[1, 2, 3], sampling=params, tokenizer_id="tok-a"))
    assert engine.abort(rid="r-a", tokenizer_id="tok-b") == 0
    assert engine.load().num_waiting_reqs == 1
    assert engine.abort(rid="r-a", tokenizer_id="tok-a") == 1
    assert engine.abort(rid="r-a") == 0  # gone
    assert (engine.load().num_waiting_reqs, engine.load().num_aborted_reqs) == (0, 1)
