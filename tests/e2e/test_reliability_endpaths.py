"""End paths: every way a request ends releases what each service owns.

Each test drives the shared stack through one end path and then asserts "back to
baseline" with ``stack.wait_idle()``: no ReqState in the tokenizer, no waiting or running
request, request slot or KV token in the scheduler, no DecodeStatus in the detokenizer.
Aborts are checked at the scheduler's own counter (``num_aborted_reqs``), so a test also
fails when a request ended at the client but ran on (or was never aborted) below.
Case C08 of docs/cases.md (its queued variant needs a one-slot stack:
test_reliability_overload.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest

from tests.helpers.ring_requests import PARIS, assert_released_after_abort, chat, read_events

LONG_STORY = [{"role": "user", "content": "Write a very long story."}]


def long_story(stack, **extra) -> dict:
    """C08's request: 2048 tokens, EOS ignored, so only an abort ends it early."""
    return chat(stack, LONG_STORY, max_tokens=2048, stream=True, ignore_eos=True, **extra)


def aborted(stack) -> int:
    return stack.scheduler_load().num_aborted_reqs


async def idle_latency(client: httpx.AsyncClient, stack) -> float:
    t0 = time.monotonic()
    resp = await client.post("/v1/chat/completions", json=chat(stack, max_tokens=8))
    assert resp.status_code == 200, resp.text
    return time.monotonic() - t0


@pytest.fixture
async def client(stack):
    stack.wait_idle()
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as c:
        yield c


@pytest.mark.parametrize(
    "extra, finish, matched",
    [
        ({}, "stop", 2),  # EOS: <|im_end|> (id 2)
        ({"stop": [" Paris"]}, "stop", " Paris"),
        ({"stop_token_ids": [7042]}, "stop", 7042),  # " Paris"
        ({"max_tokens": 3}, "length", None),
    ],
    ids=["eos", "stop-string", "stop-token", "length"],
)
@pytest.mark.parametrize("stream", [False, True])
async def test_normal_end_paths_release_everything(stack, client, extra, finish, matched, stream):
    before = aborted(stack)
    resp = await client.post("/v1/chat/completions", json=chat(stack, stream=stream, **extra))
    assert resp.status_code == 200, resp.text
    if stream:
        finishes = [line for line in resp.text.splitlines() if '"finish_reason":"' in line.replace(" ", "")]
        assert len(finishes) == 1 and f'"{finish}"' in finishes[0]
    else:
        choice = resp.json()["choices"][0]
        assert (choice["finish_reason"], choice["matched_stop"]) == (finish, matched)
    _, sched, _ = stack.wait_idle(timeout_s=5)
    assert sched.num_aborted_reqs == before


async def test_c08_disconnect_during_decode(stack, client):
    """C08 as written: read 3 chunks, close; the rid is aborted within a second, the next
    request gets idle latency."""
    idle = await idle_latency(client, stack)
    before = aborted(stack)
    assert len(await read_events(client, long_story(stack), 3)) == 3
    assert_released_after_abort(stack, before, 1, within_s=1.5)
    after = await idle_latency(client, stack)
    assert after < 2 * idle + 0.5, (idle, after)


async def test_c08_disconnect_non_streaming(stack, client):
    before = aborted(stack)
    body = {**long_story(stack), "stream": False}
    task = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    deadline = time.monotonic() + 20
    while stack.scheduler_load().num_running_reqs == 0:  # decoding
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert_released_after_abort(stack, before, 1, within_s=1.5)


async def test_c08_disconnect_n2_aborts_every_choice(stack, client):
    before = aborted(stack)
    events = await read_events(client, long_story(stack, n=2), 4)
    assert len(events) == 4
    assert_released_after_abort(stack, before, 2, within_s=1.5)


async def test_c08_disconnect_during_long_prefill(stack, client):
    """A ~560-token prompt: the client leaves before the first token (no response head yet)."""
    prompt = "Summarize the following notes. " + " ".join(f"note {i}: the sky is blue." for i in range(50))
    before = aborted(stack)
    body = chat(stack, [{"role": "user", "content": prompt}], max_tokens=64, stream=True)
    task = asyncio.create_task(read_events(client, body, 1))
    deadline = time.monotonic() + 20
    while stack.scheduler_load().kv_used_tokens == 0 and stack.scheduler_load().num_waiting_reqs == 0:
        assert time.monotonic() < deadline and not task.done()
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The abort lands between steps: at the latest when the prefill step in progress ends.
    took = assert_released_after_abort(stack, before, 1, within_s=10)
    print(f"prefill disconnect released after {took:.2f} s")


async def test_disconnect_after_final_token_before_read(stack, client):
    """The request finished below while the client had not read it: nothing to abort, nothing held."""
    before = aborted(stack)
    async with client.stream("POST", "/v1/chat/completions", json=chat(stack, max_tokens=4, stream=True)) as resp:
        assert resp.status_code == 200
        deadline = time.monotonic() + 20
        while stack.scheduler_load().num_finished_reqs == 0 or stack.tokenizer_load().req_states:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        # leave without reading the body
    _, sched, _ = stack.wait_idle(timeout_s=5)
    assert sched.num_aborted_reqs == before


async def test_abort_request_by_rid(stack, client):
    rid = f"reliability-{uuid.uuid4().hex}"
    before = aborted(stack)
    finish = None
    async with client.stream("POST", "/v1/chat/completions", json=long_story(stack, rid=rid)) as resp:
        assert resp.status_code == 200
        seen = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            seen += 1
            if seen == 3:
                r = await client.post("/abort_request", json={"rid": rid})
                assert r.status_code == 200, r.text
                assert r.json() == {"rid": rid, "aborted": True}
            if '"finish_reason":"abort"' in line.replace(" ", ""):
                finish = "abort"
    assert finish == "abort"
    assert_released_after_abort(stack, before, 1, within_s=2)
    r = await client.post("/abort_request", json={"rid": rid})
    assert r.status_code == 404


async def test_chat_template_error_releases_everything(stack, client):
    before = aborted(stack)
    body = chat(stack, PARIS, add_generation_prompt=False, continue_final_message=True)
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["type"] == "invalid_request_error"
    _, sched, _ = stack.wait_idle(timeout_s=5)
    assert sched.num_aborted_reqs == before


async def test_duplicate_in_flight_rid_is_400_and_first_is_untouched(stack, client):
    alone = (await client.post("/v1/chat/completions", json=chat(stack, max_tokens=48))).json()
    rid = f"dup-{uuid.uuid4().hex}"
    before = aborted(stack)
    texts = []
    body = chat(stack, max_tokens=48, stream=True, rid=rid)
    async with client.stream("POST", "/v1/chat/completions", json=body) as first:
        assert first.status_code == 200
        dup = await client.post("/v1/chat/completions", json=chat(stack, max_tokens=48, rid=rid))
        assert dup.status_code == 400, dup.text
        err = dup.json()["error"]
        assert err["code"] == "duplicate_request_id" and err["param"] == "rid"
        assert rid in err["message"] and "already in flight" in err["message"]
        async for line in first.aiter_lines():
            if line.startswith("data: {"):
                import json

                for c in json.loads(line[6:])["choices"]:
                    texts.append(c["delta"].get("content") or "")
    assert "".join(texts) == alone["choices"][0]["message"]["content"]
    _, sched, _ = stack.wait_idle(timeout_s=5)
    assert sched.num_aborted_reqs == before


async def test_abort_while_another_prefills_leaves_it_untouched(stack, client):
    """Two clients race: one leaves while the other's long prompt is being prefilled."""
    prompt = "Answer briefly. " + " ".join(f"fact {i}: water is wet." for i in range(50)) + " What is wet?"
    body = chat(stack, [{"role": "user", "content": prompt}], max_tokens=24)
    alone = (await client.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]["content"]
    stack.wait_idle()
    before = aborted(stack)
    leaver = asyncio.create_task(read_events(client, long_story(stack), 10_000))
    while stack.scheduler_load().num_running_reqs == 0:
        await asyncio.sleep(0.02)
    stayer = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    while stack.scheduler_load().num_running_reqs + stack.scheduler_load().num_waiting_reqs < 2:
        await asyncio.sleep(0.01)
    leaver.cancel()
    resp = await stayer
    with pytest.raises(asyncio.CancelledError):
        await leaver
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["message"]["content"] == alone
    assert_released_after_abort(stack, before, 1, within_s=5)
