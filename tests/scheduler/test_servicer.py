"""The scheduler service over real gRPC on localhost, with an in-test detokenizer."""

from __future__ import annotations

import asyncio

import grpc

from ringserve import sampling_params
from ringserve.grpcutil import insecure_channel, start_server, wait_serving
from ringserve.v1 import common_pb2, detokenizer_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from services.scheduler.config import EngineConfig, SchedulerConfig
from services.scheduler.main import serve


class RecordingDetokenizer(detokenizer_pb2_grpc.DetokenizerServicer):
    """Records every BatchTokenIDOutput; wakes waiters on each one."""

    def __init__(self):
        self.messages = []
        self.changed = asyncio.Condition()

    async def Stream(self, request_iterator, context):
        await context.send_initial_metadata(())  # accepted, as the real detokenizer announces
        async for msg in request_iterator:
            async with self.changed:
                self.messages.append(msg)
                self.changed.notify_all()

    def rows(self, rid: str):
        """(message, row index) pairs for rid, in arrival order."""
        return [(m, i) for m in self.messages for i, r in enumerate(m.rids) if r == rid]

    async def wait_for(self, predicate, timeout_s: float = 60.0):
        async with self.changed:
            await asyncio.wait_for(self.changed.wait_for(predicate), timeout_s)

    def finished(self, rid: str) -> bool:
        rows = self.rows(rid)
        return bool(rows) and rows[-1][0].finish_reasons[rows[-1][1]].type != common_pb2.FINISH_NONE


def request(rid: str, ids: list[int], max_new_tokens: int, **kw) -> scheduler_pb2.SchedulerInput:
    params = common_pb2.ResolvedSamplingParams(**{
        **sampling_params.resolved_defaults(), "temperature": 0.0, "max_new_tokens": max_new_tokens,
        "ignore_eos": True}, stop=["zz top"])
    return scheduler_pb2.SchedulerInput(req=scheduler_pb2.TokenizedGenerateReqInput(
        rid=rid, input_ids=ids, sampling_params=params, **kw))


async def open_stream(stub, tokenizer_id: str):
    """A Connect stream fed from a queue; the hello goes first."""
    queue: asyncio.Queue = asyncio.Queue()
    await queue.put(scheduler_pb2.SchedulerInput(abort=scheduler_pb2.AbortReq(tokenizer_id=tokenizer_id)))

    async def messages():
        while (msg := await queue.get()) is not None:
            yield msg

    return queue, stub.Connect(messages())


async def test_scheduler_service_end_to_end(smollm2_dir, chat_ids):
    detok = RecordingDetokenizer()
    detok_server = await start_server(
        "127.0.0.1:0", [(detokenizer_pb2_grpc.add_DetokenizerServicer_to_server, detok, "ringserve.v1.Detokenizer")])
    cfg = SchedulerConfig(
        engine=EngineConfig(model=smollm2_dir, max_running_requests=8, max_total_tokens=4096),
        port=0, detokenizer=f"127.0.0.1:{detok_server.port}", instance_id="sched-test", torch_threads=2,
    )
    stop = asyncio.Event()
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    service = asyncio.create_task(serve(cfg, stop, ready.set_result))
    port = await asyncio.wait_for(ready, 60)
    channel = insecure_channel(f"127.0.0.1:{port}")
    try:
        assert await wait_serving(channel, "ringserve.v1.Scheduler")
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        base = await stub.GetLoad(common_pb2.Empty())
        assert (base.instance_id, base.num_running_reqs, base.kv_used_tokens,
                base.kv_total_tokens) == ("sched-test", 0, 0, 4096)

        queue, call = await open_stream(stub, "tok-1")
        first_event = await call.read()
        assert first_event.load.instance_id == "sched-test"
        prompt = chat_ids("Name three rivers.")
        await queue.put(request("r1", prompt, 6))
        await queue.put(request("bad", [1, 10**6], 6))
        await detok.wait_for(lambda: detok.finished("r1") and detok.finished("bad"))

        rows = detok.rows("r1")
        assert len(rows) == 6
        msg, i = rows[0]
        init = next(x for x in msg.inits if x.row == i)
        assert list(init.prompt_tail_ids) == prompt[-5:] and list(init.stop) == ["zz top"]
        assert all(m.finish_reasons[j].type == common_pb2.FINISH_NONE for m, j in rows[:-1])
        assert all(not any(x.row == j for x in m.inits) for m, j in rows[1:])
        last, j = rows[-1]
        assert last.finish_reasons[j].type == common_pb2.FINISH_LENGTH
        assert (last.completion_tokens[j], last.prompt_tokens[j], last.tokenizer_ids[j]) == (6, len(prompt), "tok-1")
        bad_msg, k = detok.rows("bad")[0]
        assert bad_msg.finish_reasons[k].type == common_pb2.FINISH_ABORT
        assert bad_msg.finish_reasons[k].status == "INVALID_ARGUMENT"

        # A tokenizer stream that closes takes its in-flight requests with it.
        await queue.put(request("long", prompt, 3000))
        await detok.wait_for(lambda: len(detok.rows("long")) >= 3)
        call.cancel()
        await detok.wait_for(lambda: detok.finished("long"))
        m, j = detok.rows("long")[-1]
        assert (m.finish_reasons[j].type, m.finish_reasons[j].status) == (common_pb2.FINISH_ABORT, "UNAVAILABLE")
        load = await stub.GetLoad(common_pb2.Empty())
        assert (load.num_running_reqs, load.num_waiting_reqs, load.req_slots_used, load.kv_used_tokens) == (0, 0, 0, 0)
        assert (load.num_finished_reqs, load.num_aborted_reqs) == (1, 2)

        # The first message must be a hello.
        bad_call = stub.Connect(iter([request("x", prompt, 2)]))
        try:
            await bad_call.read()
            raise AssertionError("Connect accepted a stream without a hello")
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        stop.set()
        await asyncio.wait_for(service, 30)
        await channel.close()
        await detok_server.stop(None)


async def test_detokenizer_restart_reconnects_and_aborts_in_flight(smollm2_dir, chat_ids):
    first = RecordingDetokenizer()
    add = detokenizer_pb2_grpc.add_DetokenizerServicer_to_server
    server = await start_server("127.0.0.1:0", [(add, first, "ringserve.v1.Detokenizer")])
    port = server.port
    cfg = SchedulerConfig(
        engine=EngineConfig(model=smollm2_dir, max_running_requests=4, max_total_tokens=4096),
        port=0, detokenizer=f"127.0.0.1:{port}", torch_threads=2,
    )
    stop = asyncio.Event()
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    service = asyncio.create_task(serve(cfg, stop, ready.set_result))
    channel = insecure_channel(f"127.0.0.1:{await asyncio.wait_for(ready, 60)}")
    second = RecordingDetokenizer()
    try:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        queue, call = await open_stream(stub, "tok-r")
        await call.read()
        await queue.put(request("long", chat_ids("Tell a long story."), 3000))
        await first.wait_for(lambda: len(first.rows("long")) >= 2)
        await server.stop(None)
        server = await start_server(f"127.0.0.1:{port}", [(add, second, "ringserve.v1.Detokenizer")])
        # The new detokenizer has no state for "long": it gets the abort with a RowInit again.
        await second.wait_for(lambda: second.finished("long"))
        m, j = second.rows("long")[-1]
        assert (m.finish_reasons[j].type, m.finish_reasons[j].status) == (common_pb2.FINISH_ABORT, "UNAVAILABLE")
        assert any(x.row == j for x in m.inits)
        load = await stub.GetLoad(common_pb2.Empty())
        assert (load.num_running_reqs, load.req_slots_used, load.kv_used_tokens) == (0, 0, 0)
        # Requests after the restart are served through the new stream.
        await queue.put(request("after", chat_ids("Hi."), 4))
        await second.wait_for(lambda: second.finished("after"))
        m, j = second.rows("after")[-1]
        assert (m.finish_reasons[j].type, m.completion_tokens[j]) == (common_pb2.FINISH_LENGTH, 4)
        call.cancel()
    finally:
        stop.set()
        await asyncio.wait_for(service, 30)
        await channel.close()
        await server.stop(None)
