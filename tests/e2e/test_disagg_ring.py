"""Prefill/decode disaggregation through the whole ring: ``ringserve launch --prefill-replicas 1
--decode-replicas 1`` (bf16, deterministic inference on by default on the CPU) answers as the
co-located bf16 ring ``tls_ring`` does, token for token and logprob for logprob; each scheduler
reports its role; both go back to baseline.

One ring of its own (``pd_ring``): no session ring has a prefill and a decode scheduler. Its
last test kills the decode scheduler.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx

from ringserve.v1 import common_pb2, scheduler_pb2_grpc
from tests.helpers.ring_requests import chat, read_stream, wait_until
from tests.helpers.ringstack import launched
from tests.helpers.tiers import ring_fixture

LONG = "Tell me about lighthouses, the sea, the wind and the ships. " * 6  # > 64 tokens: chunked prefill

BODIES = [
    {"messages": [{"role": "user", "content": LONG}], "max_tokens": 10, "logprobs": True, "top_logprobs": 2},
    {"messages": [{"role": "user", "content": "Count from one to ten."}], "max_tokens": 30, "stop": ["4"]},
    {"messages": [{"role": "user", "content": "Write a line about bread."}], "max_tokens": 8, "n": 2,
     "temperature": 0.9, "seed": 11, "logprobs": True},
    {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 1},
]


@ring_fixture(scope="module")
def pd_ring(smollm2_dir, tmp_path_factory):
    with launched(smollm2_dir, "--dtype", "bfloat16", "--prefill-replicas", "1", "--decode-replicas", "1",
                  "--chunked-prefill-size", "64", "--max-total-tokens", "8192",
                  log_path=tmp_path_factory.mktemp("pd-ring") / "ring.log") as ring:
        yield ring


def _load(ring, address: str) -> common_pb2.LoadReport:
    with grpc.insecure_channel(address) as ch:
        return scheduler_pb2_grpc.SchedulerStub(ch).GetLoad(common_pb2.Empty(), timeout=5,
                                                            metadata=ring.internal_metadata)


async def _answers(ring, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=120) as client:
        resps = await asyncio.gather(*(client.post("/v1/chat/completions", json={
            "model": ring.model_name, "temperature": 0, **body}) for body in bodies))
    assert [r.status_code for r in resps] == [200] * len(bodies), [r.text for r in resps]
    return [r.json() for r in resps]


def test_a_prefill_decode_pair_answers_as_one_scheduler(pd_ring, tls_ring):
    want = asyncio.run(_answers(tls_ring, BODIES))
    got = asyncio.run(_answers(pd_ring, BODIES))  # all at once: several handoffs in flight
    for g, w in zip(got, want, strict=True):
        assert g["choices"] == w["choices"]  # text, finish_reason, matched_stop, logprobs: bit for bit
        assert g["usage"]["completion_tokens"] == w["usage"]["completion_tokens"]
    assert got[1]["choices"][0]["finish_reason"] == "stop" and got[1]["choices"][0]["matched_stop"] == "4"
    assert len(got[0]["choices"][0]["logprobs"]["content"]) == 10
    # The prompt again: the prefill side's prefix cache supplies all of it but the last token.
    again = asyncio.run(_answers(pd_ring, BODIES[:1]))[0]
    assert again["choices"] == want[0]["choices"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1


def test_each_scheduler_reports_its_role_and_goes_back_to_baseline(pd_ring):
    """...after chats and an embedding call (which the prefill scheduler serves alone: nothing
    reserved on the decode side, so the baseline comes at once, not after the transfer timeout)."""
    (prefill, _), (decode, _) = pd_ring.replicas()
    asyncio.run(_answers(pd_ring, BODIES[3:]))
    embedded = httpx.post(f"{pd_ring.base_url}/v1/embeddings", timeout=60, headers=pd_ring.http_headers,
                          json={"model": pd_ring.model_name, "input": ["hello world", "a b c d e", "x"]})
    assert embedded.status_code == 200 and len(embedded.json()["data"]) == 3, embedded.text
    loads = {}
    for _ in range(100):
        loads = {a: _load(pd_ring, a) for a in (prefill, decode)}
        if all(r.req_slots_used == 0 and r.kv_used_tokens == 0 and r.num_transfer_reqs == 0 for r in loads.values()):
            break
        asyncio.run(asyncio.sleep(0.05))
    assert [loads[a].disaggregation_mode for a in (prefill, decode)] == ["prefill", "decode"]
    assert [(r.req_slots_used, r.kv_used_tokens, r.num_transfer_reqs, r.num_running_reqs, r.num_waiting_reqs)
            for r in loads.values()] == [(0, 0, 0, 0, 0)] * 2
    assert pd_ring.tokenizer_load().req_states == 0
    metrics = pd_ring.scrape("scheduler")  # the first scheduler's: the prefill one
    assert metrics[("ringserve:disaggregation_role", (("model_name", pd_ring.model_name),))] == 1
    assert metrics[("ringserve:kv_transfer_bytes_total", (("model_name", pd_ring.model_name),))] > 0


async def test_a_killed_decode_scheduler_fails_its_streams_within_2_s(pd_ring):
    (prefill, _), (decode, _) = pd_ring.replicas()
    async with httpx.AsyncClient(base_url=pd_ring.base_url, timeout=120) as client:
        bodies = [chat(pd_ring, [{"role": "user", "content": f"Write a long story about the number {i}."}],
                       max_tokens=200, stream=True, ignore_eos=True) for i in range(2)]
        started = [asyncio.Event() for _ in bodies]
        streams = [asyncio.create_task(read_stream(client, b, e)) for b, e in zip(bodies, started, strict=True)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)  # both streams decode
        killed_at = time.monotonic()
        pd_ring.kill("scheduler", decode)
        done, _ = await asyncio.wait(streams, timeout=2.0)
        assert len(done) == 2
        for task in done:
            events, ended = task.result()
            assert ended - killed_at < 2.0 and events[-1] == "[DONE]"
            assert events[-2]["error"]["type"] == "service_unavailable_error", events[-2]
            assert f"lost the connection to the scheduler at {decode}" in events[-2]["error"]["message"]
    await wait_until(lambda: _load(pd_ring, prefill).req_slots_used == 0, 10, "the prefill side idle")
    assert pd_ring.tokenizer_load().req_states == 0
