"""The internal ports of the shared ring: a caller without the ring's credential, or with it
but posing as the ring's own tokenizer, is refused, and the ring serves on untouched.

One long stream runs through every attempt: the scheduler's and the detokenizer's RPCs
without the credential, with a wrong one and with the right one sent as a public API key
end UNAUTHENTICATED (the Subscribe naming the real tokenizer's id: the hijack that used
to take every client's output); with the credential, a second Subscribe or Connect hello
claiming the real tokenizer's id ends ALREADY_EXISTS, and aborts naming that tokenizer or
its rid abort nothing. After the attempts the stream still runs and its output still
reaches its client, a greedy chat beside it is answered exactly, and once the stream is
closed (its one abort) every service goes back to idle.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc
import httpx
import orjson
import pytest

from ringserve.internal_auth import MISSING, WRONG
from ringserve.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tokenizer_pb2_grpc,
)
from tests.helpers.ringstack import still_serves

STORY = [{"role": "user", "content": "Write a very long story."}]
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def tokenizer_id(stack) -> str:
    """The real tokenizer's instance id (what an attacker reads in its log)."""
    with grpc.insecure_channel(stack.tokenizer) as ch:
        return tokenizer_pb2_grpc.TokenizerStub(ch).GetLoad(common_pb2.Empty(), timeout=10).instance_id


def hello(tokenizer: str) -> scheduler_pb2.SchedulerInput:
    return scheduler_pb2.SchedulerInput(abort=scheduler_pb2.AbortReq(rid="", tokenizer_id=tokenizer))


def internal_calls(stack, victim: str) -> dict[str, callable]:
    """Each internal RPC, called with the given metadata; returns what it streamed or answered."""

    def subscribe(ch, md):
        return next(detokenizer_pb2_grpc.DetokenizerStub(ch).Subscribe(
            detokenizer_pb2.SubscribeRequest(tokenizer_id=victim), metadata=md, timeout=5))

    def connect(ch, md):
        return list(scheduler_pb2_grpc.SchedulerStub(ch).Connect(iter([hello(victim)]), metadata=md, timeout=5))

    def stream(ch, md):
        return list(detokenizer_pb2_grpc.DetokenizerStub(ch).Stream(iter([]), metadata=md, timeout=5))

    return {
        "Detokenizer.Subscribe": (stack.detokenizer, subscribe),
        "Detokenizer.Stream": (stack.detokenizer, stream),
        "Detokenizer.GetLoad": (stack.detokenizer,
                                lambda ch, md: detokenizer_pb2_grpc.DetokenizerStub(ch).GetLoad(
                                    common_pb2.Empty(), metadata=md, timeout=5)),
        "Scheduler.Connect": (stack.scheduler, connect),
        "Scheduler.GetLoad": (stack.scheduler,
                              lambda ch, md: scheduler_pb2_grpc.SchedulerStub(ch).GetLoad(
                                  common_pb2.Empty(), metadata=md, timeout=5)),
    }


def refusal(address: str, call, metadata) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as info:
        call(ch, metadata)
    return info.value.code(), info.value.details()


def attempts(stack, victim: str, rid: str) -> None:
    """Every hijack attempt; each must be refused with its exact status and message."""
    (key, token), = stack.internal_metadata
    bad = {(): MISSING, ((key, token + "x"),): WRONG, ((key, "not-the-token"),): WRONG,
           (("authorization", f"Bearer {token}"),): MISSING}
    for name, (address, call) in internal_calls(stack, victim).items():
        for metadata, message in bad.items():
            assert refusal(address, call, metadata) == (grpc.StatusCode.UNAUTHENTICATED, message), (name, metadata)
    # With the credential: the real tokenizer's id is taken on both ports.
    good = stack.internal_metadata
    calls = internal_calls(stack, victim)
    assert refusal(*calls["Detokenizer.Subscribe"], good) == (
        grpc.StatusCode.ALREADY_EXISTS, f"tokenizer {victim!r} is already subscribed on another stream")
    assert refusal(*calls["Scheduler.Connect"], good) == (
        grpc.StatusCode.ALREADY_EXISTS, f"tokenizer {victim!r} is already connected on another stream")
    # A stream of its own cannot abort the real tokenizer's requests, by id or by rid.
    own = f"tok-intruder-{uuid.uuid4().hex}"
    aborts = [scheduler_pb2.SchedulerInput(abort=scheduler_pb2.AbortReq(abort_all=True, tokenizer_id=victim)),
              scheduler_pb2.SchedulerInput(abort=scheduler_pb2.AbortReq(rid=rid, tokenizer_id=victim)),
              scheduler_pb2.SchedulerInput(abort=scheduler_pb2.AbortReq(rid=rid))]
    with grpc.insecure_channel(stack.scheduler) as ch:
        events = list(scheduler_pb2_grpc.SchedulerStub(ch).Connect(iter([hello(own), *aborts]), metadata=good,
                                                                   timeout=10))
    assert events and events[0].HasField("load")


async def test_internal_ports_refuse_intruders_and_the_ring_serves_on(stack):
    stack.wait_idle()
    victim = tokenizer_id(stack)
    assert victim.startswith("tok-")
    rid = f"victim-{uuid.uuid4().hex}"
    body = {"model": stack.model_name, "messages": STORY, "max_tokens": 2048, "temperature": 0, "stream": True,
            "ignore_eos": True, "rid": rid}
    before = stack.scheduler_load()
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = aiter(resp.aiter_lines())

            async def chunks(k: int) -> list[dict]:
                out = []
                while len(out) < k:
                    line = await anext(lines)
                    if line.startswith("data: "):
                        out.append(orjson.loads(line[len("data: "):]))
                return out

            await chunks(1)  # in flight
            await asyncio.to_thread(attempts, stack, victim, rid)
            assert stack.scheduler_load().num_running_reqs == 1  # not aborted by any attempt
            # A second request completes with the right text beside it, and the first one's
            # output still reaches its own client.
            paris = await client.post("/v1/chat/completions", json={
                "model": stack.model_name, "messages": PARIS, "max_tokens": 16, "temperature": 0})
            assert paris.status_code == 200, paris.text
            assert paris.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
            later = await chunks(3)
            assert all(c["choices"][0]["finish_reason"] is None for c in later)
    # Closing the stream aborts the long request: the only abort, and every service goes idle.
    _, sched, _ = stack.wait_idle(timeout_s=15)
    assert sched.num_aborted_reqs == before.num_aborted_reqs + 1
    still_serves(stack)


def test_the_credential_is_on_no_command_line(stack):
    (_, token), = stack.internal_metadata
    for name in ("gateway", "tokenizer", "scheduler", "detokenizer"):
        with open(f"/proc/{stack.pid(name)}/cmdline", "rb") as f:
            cmdline = f.read().decode()
        assert token not in cmdline and "--internal-token" not in cmdline, name
