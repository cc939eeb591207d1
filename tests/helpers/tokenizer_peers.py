"""In-test scheduler and detokenizer peers of a tokenizer service, over real gRPC.

The fake scheduler answers each dispatched request by pushing a canned BatchStrOutput
script (``SCRIPT``) for its rid to the fake detokenizer, which streams it to the subscribed
tokenizer instance. In "hold" mode only the first row is sent and the request stays running
until an AbortReq arrives, which is answered with a FINISH_ABORT row, as a real scheduler does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc

from ringserve.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2,
)

SCRIPT = [("Hello", [19556], None), (", world", [28, 905], None),
          ("!", [17], common_pb2.FinishReason(type=common_pb2.FINISH_STOP, matched_token_id=2))]
TIMEOUT_S = 10


def row_batch(rid: str, text: str, ids: list[int], finish: common_pb2.FinishReason | None,
              completion: int) -> detokenizer_pb2.BatchStrOutput:
    return detokenizer_pb2.BatchStrOutput(
        rids=[rid], texts=[text], new_token_counts=[len(ids)], output_ids=ids,
        finish_reasons=[finish or common_pb2.FinishReason()], prompt_tokens=[0],
        completion_tokens=[completion], cached_tokens=[0],
    )


class FakeDetokenizer(detokenizer_pb2_grpc.DetokenizerServicer):
    def __init__(self) -> None:
        self.subscribers: dict[str, asyncio.Queue[detokenizer_pb2.BatchStrOutput]] = {}

    async def Subscribe(self, request, context):
        queue: asyncio.Queue[detokenizer_pb2.BatchStrOutput] = asyncio.Queue()
        self.subscribers[request.tokenizer_id] = queue
        await context.send_initial_metadata(())  # "registered": the tokenizer may report SERVING
        try:
            while True:
                yield await queue.get()
        finally:
            self.subscribers.pop(request.tokenizer_id, None)

    def send(self, tokenizer_id: str, batch: detokenizer_pb2.BatchStrOutput) -> None:
        if tokenizer_id in self.subscribers:  # rows for an instance that is not subscribed are dropped
            self.subscribers[tokenizer_id].put_nowait(batch)


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, detokenizer: FakeDetokenizer) -> None:
        self.detokenizer = detokenizer
        self.hellos: list[scheduler_pb2.AbortReq] = []
        self.reqs: list[scheduler_pb2.TokenizedGenerateReqInput] = []
        self.aborts: list[scheduler_pb2.AbortReq] = []
        self.running: dict[str, tuple[str, int]] = {}  # rid -> (tokenizer_id, completion tokens)
        self.hold = False

    async def Connect(self, request_iterator, context):
        async for msg in request_iterator:
            if msg.WhichOneof("msg") == "req":
                self._run(msg.req)
            elif not msg.abort.rid:
                self.hellos.append(msg.abort)
                await context.send_initial_metadata(())  # accepted, as a real scheduler's first event says
            else:
                self.aborts.append(msg.abort)
                if msg.abort.rid in self.running:
                    tid, done = self.running.pop(msg.abort.rid)
                    fr = common_pb2.FinishReason(type=common_pb2.FINISH_ABORT, status="CANCELLED",
                                                 message=msg.abort.reason)
                    self.detokenizer.send(tid, row_batch(msg.abort.rid, "", [], fr, done))

    def _run(self, req: scheduler_pb2.TokenizedGenerateReqInput) -> None:
        self.reqs.append(req)
        script = SCRIPT[:1] if self.hold else SCRIPT
        for i, (text, ids, finish) in enumerate(script):
            self.detokenizer.send(req.tokenizer_id, row_batch(req.rid, text, ids, finish, i + 1))
        if self.hold:
            self.running[req.rid] = (req.tokenizer_id, 1)


async def wait_for_value(read: Callable[[], Awaitable[int]], want: int, timeout_s: float = TIMEOUT_S) -> None:
    """Poll ``read`` until it returns ``want`` (TimeoutError after ``timeout_s``)."""

    async def poll() -> None:
        while await read() != want:
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout_s)


async def collect(call) -> list[tokenizer_pb2.GenerateOutput]:
    return await asyncio.wait_for(_collect(call), TIMEOUT_S)


async def _collect(call) -> list[tokenizer_pb2.GenerateOutput]:
    outs = []
    while (out := await call.read()) is not grpc.aio.EOF:
        outs.append(out)
    return outs
