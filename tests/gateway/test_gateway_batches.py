"""Completions batches (against scripted fake tokenizers): at most 2048 prompts, and a big
batch never overfills gRPC's queue of calls the tokenizer has not taken up yet (which
cancelled them: a 503 for 1,500 prompts).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from ringserve import grpcutil
from ringserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway.backend import MAX_OPENING_CALLS, TokenizerClient
from services.gateway.config import GatewayConfig
from tests.helpers.gateway_requests import assert_error, body_for

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_batch_over_the_prompt_limit_is_a_400(stack):
    stack.fake.reset(stack.out("never", finish="stop"))
    r = await stack.client.post("/v1/completions", json=body_for("/v1/completions", {"prompt": ["hi"] * 2049}))
    err = assert_error(r, 400, "prompt", "invalid_value")
    assert err["message"] == "prompt: a batch holds at most 2048 prompts, got 2049; split it into several requests"
    assert stack.fake.requests == []


class SlowToTakeUp(tokenizer_pb2_grpc.TokenizerServicer):
    """A tokenizer whose event loop is busy for a while at the first call (as a real one is
    while it renders and tokenizes), so the calls behind it wait in gRPC's queue."""

    def __init__(self) -> None:
        self.open = 0
        self.peak = 0
        self.served = 0

    async def Generate(self, request, context):
        if self.served == 0 and self.open == 0:
            time.sleep(1.0)  # blocks this server's loop: no call is taken up meanwhile
        self.open += 1
        self.peak = max(self.peak, self.open)
        await asyncio.sleep(0.01)
        self.open -= 1
        self.served += 1
        yield tokenizer_pb2.GenerateOutput(rid=request.rid, text="x", completion_tokens=1,
                                           finish_reason=common_pb2.FinishReason(type=common_pb2.FINISH_LENGTH))

    async def GetModelInfo(self, request, context):
        return tokenizer_pb2.ModelInfo(served_model_name="smol", context_length=2048, vocab_size=49152)


def _serve_in_thread(servicer) -> tuple[int, asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    started: list = []

    async def start():
        server = await grpcutil.start_server(
            "127.0.0.1:0", [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, servicer, "ringserve.v1.Tokenizer")])
        started.append(server)

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    while not started:
        time.sleep(0.01)
    return started[0], loop, thread


async def test_a_big_batch_never_overfills_grpcs_queue_of_calls_not_taken_up():
    """1,500 calls at once: gRPC's server keeps 1,000 that the tokenizer has not taken up and
    cancels the others (a 503 for the whole batch); opened at most 256 at a time, all are served."""
    servicer = SlowToTakeUp()
    server, loop, thread = _serve_in_thread(servicer)
    client = TokenizerClient(GatewayConfig(tokenizer=f"127.0.0.1:{server.port}"))
    try:
        reqs = [tokenizer_pb2.GenerateReqInput(rid=f"batch-{i}", text="hi") for i in range(1500)]
        streams = await client.open_streams(reqs)
        assert len(streams) == 1500 and servicer.served == 1500
        assert servicer.peak <= MAX_OPENING_CALLS == 256
    finally:
        await client.close()
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
