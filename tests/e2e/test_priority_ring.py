"""Priority scheduling end to end, on the session's ring launched with ``--schedule-policy
priority``, two request slots and a 128-token KV pool (``priority_ring``, tests/e2e/conftest.py),
and the refusal of a priority on the default ring (``stack``, first come first served).

No per-request queue time leaves the ring (``/generate``'s meta_info has none, and the
scheduler's queue-time histogram is not per request), so the queue-time proof reads the time
each streaming client gets its first token: with the slots full and four priority-0 requests
waiting, a priority -1 request sent after them gets its first token before every one of them,
so its queue time (send to first token, less one prefill) is below each of theirs.

The retraction proof reads the scheduler's log line for each retraction (``retracted request
RID (priority P, ...)``), and compares the outputs with the same requests run alone (greedy).
"""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import httpx
import pytest

from ringserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc

TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
        "books were made, sold and read across Europe, and with them how ideas travelled between cities. "
        "Within fifty years presses ran in more than two hundred towns.")  # 48 tokens
REFUSAL = ("priority must be 0 under --schedule-policy fcfs: the scheduler orders requests by priority only when "
           "started with --schedule-policy priority")


@pytest.fixture
def ring(priority_ring):
    return priority_ring


def completion(rid: str, priority: int, max_tokens: int) -> dict:
    return {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "rid": rid, "priority": priority}


async def first_token_after(client: httpx.AsyncClient, body: dict) -> float:
    """Stream ``body`` to its end; seconds from sending it to its first text event."""
    sent = time.monotonic()
    first = None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.monotonic() - sent
    assert first is not None
    return first


async def wait_load(ring, running: int, waiting: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while (load := ring.scheduler_load()).num_running_reqs != running or load.num_waiting_reqs != waiting:
        assert time.monotonic() < deadline, load
        await asyncio.sleep(0.02)


async def test_a_priority_minus_one_request_waits_less_than_every_earlier_priority_zero_one(ring):
    ring.wait_idle()
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=120) as client:
        # Two blockers of different lengths fill both slots and free them one at a time.
        blockers = [asyncio.create_task(first_token_after(client, completion(f"block{i}", 0, 40 + 10 * i)))
                    for i in range(2)]
        await wait_load(ring, 2, 0)
        zeros = [asyncio.create_task(first_token_after(client, completion(f"zero{i}", 0, 4))) for i in range(4)]
        await wait_load(ring, 2, 4)
        urgent = await first_token_after(client, completion("urgent", -1, 4))
        waits = await asyncio.gather(*zeros)
        await asyncio.gather(*blockers)
    assert all(urgent < w for w in waits), (urgent, waits)
    ring.wait_idle()


async def test_under_kv_pressure_the_lowest_priority_is_retracted_and_outputs_are_unchanged(ring):
    ring.wait_idle()
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=120) as client:
        tokens = (await client.post("/v1/tokenize", json={"prompt": TEXT})).json()["tokens"]
        prompts = {"low": tokens[:40], "high": tokens[1:41]}  # no common prefix
        logged = len(ring.log())

        def body(rid: str, priority: int) -> dict:
            return {"input_ids": prompts[rid.split("-")[0]], "rid": rid, "priority": priority,
                    "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}}

        # Both prompts fit at admission (82 rows), not both finished sequences (176 > 128 rows).
        # "low" starts first, so the least-progress rule alone would retract "high".
        low = asyncio.create_task(client.post("/generate", json=body("low-1", 5)))
        await wait_load(ring, 1, 0)
        high = await client.post("/generate", json=body("high-1", 0))
        together = {"low": (await low).json(), "high": high.json()}
        retracted = re.findall(r"retracted request (\S+) \(priority (-?\d+),", ring.log()[logged:])
        assert retracted and set(retracted) == {("low-1", "5")}, retracted
        alone = {rid: (await client.post("/generate", json=body(f"{rid}-2", p))).json()
                 for rid, p in (("low", 5), ("high", 0))}
    for rid in ("low", "high"):
        assert together[rid]["meta_info"]["completion_tokens"] == 48
        assert together[rid]["output_ids"] == alone[rid]["output_ids"], rid
    assert set(re.findall(r"retracted request (\S+) ", ring.log()[logged:])) == {"low-1"}  # none when alone
    ring.wait_idle()


async def test_the_default_policy_refuses_a_priority_by_name(stack):
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
                           ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                           ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}})):
            r = await client.post(path, json={**body, "priority": 1})
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert (err["message"], err["param"], err["code"]) == (REFUSAL, "priority", "invalid_value"), path
        ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "priority": 0})
        assert ok.status_code == 200, ok.text
    with grpc.insecure_channel(stack.tokenizer) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(tokenizer_pb2.GenerateReqInput(text="hi", priority=-1), timeout=30,
                               metadata=stack.grpc_metadata))
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, REFUSAL)
    stack.wait_idle()
