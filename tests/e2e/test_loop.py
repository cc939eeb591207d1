"""The four services serve SmolLM2 end to end."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ringserve.client import AsyncRingserveClient, RingserveClient

REPO = Path(__file__).resolve().parents[2]

# 20 prompts: English, CJK, Hangul, emoji, accents, code.
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Translate to Chinese: I love programming.",
    "请用中文介绍一下长城。",
    "日本の首都はどこですか？",
    "한국어로 인사해 주세요.",
    "Describe a cat using only emoji 🐱.",
    "Explain what 👩‍💻 means and use 🇯🇵 in a sentence.",
    "Write a Python function that reverses a string.",
    "def fibonacci(n):\n    # complete this function\n",
    "Write a JSON object with keys name and age.",
    "What does `git rebase -i` do?",
    "Café, naïve, façade: explain the accents.",
    "List three prime numbers greater than 100.",
    "Ecris une phrase en français sur la mer.",
    "Schreibe einen Satz über Berlin.",
    "Напиши одно предложение о Москве.",
    "What is 17 * 23?",
    "Give me a SQL query that counts rows in a table named users.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
]


def _chat_body(model: str, prompt: str, stream: bool, max_tokens: int = 48) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


async def _stream_text(client: httpx.AsyncClient, body: dict) -> tuple[str, str, list[str]]:
    """POST a streaming chat request; return (text, finish_reason, raw event lines)."""
    events: list[str] = []
    text = []
    finish = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line:
                continue
            events.append(line)
            assert line.startswith("data: ")
            payload = line[len("data: "):]
            if payload == "[DONE]":
                continue
            import json

            chunk = json.loads(payload)
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
                if choice["finish_reason"] is not None:
                    finish = choice["finish_reason"]
    return "".join(text), finish, events


async def _full_text(client: httpx.AsyncClient, body: dict) -> tuple[str, dict]:
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    return data["choices"][0]["message"]["content"], data


def test_openai_sdk_streams_chat(stack):
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=stack.model_name,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert "Paris" in text
    assert finishes == ["stop"]


async def test_sse_stream_ends_with_done(stack):
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        text, finish, events = await _stream_text(
            client, _chat_body(stack.model_name, "What is the capital of France?", True, 32)
        )
    assert events[-1] == "data: [DONE]"
    assert events.count("data: [DONE]") == 1
    assert finish == "stop"
    assert text == "The capital of France is Paris."


async def test_greedy_streaming_equals_non_streaming(stack):
    # All 20 at once: also exercises batching (fp32 greedy output does not depend on the batch).
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        streamed = await asyncio.gather(
            *(_stream_text(client, _chat_body(stack.model_name, p, True)) for p in PROMPTS)
        )
        full = await asyncio.gather(
            *(_full_text(client, _chat_body(stack.model_name, p, False)) for p in PROMPTS)
        )
    for prompt, (text, finish, _), (full_text, data) in zip(PROMPTS, streamed, full, strict=True):
        assert text == full_text, prompt
        assert finish == data["choices"][0]["finish_reason"], prompt
        assert text, prompt
        assert "\ufffd" not in text, prompt
    stack.wait_idle()


async def _completion(client: httpx.AsyncClient, body: dict) -> tuple[str, str, object]:
    """POST /v1/completions, streamed or not; return (text, finish_reason, matched_stop)."""
    if not body["stream"]:
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        return choice["text"], choice["finish_reason"], choice.get("matched_stop")
    text, finish, matched = [], None, None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            import json

            for choice in json.loads(line[len("data: "):])["choices"]:
                text.append(choice["text"])
                if choice["finish_reason"] is not None:
                    finish, matched = choice["finish_reason"], choice.get("matched_stop")
    return "".join(text), finish, matched


async def test_greedy_streaming_equals_non_streaming_with_stop_strings(stack):
    # Stop strings that end inside a token, span several tokens, or are single characters.
    stops = [[" the"], ["e"], [", "], ["\n"], [" is a", "."]]
    cases = [(p, stops[i % len(stops)]) for i, p in enumerate(PROMPTS)]

    def body(prompt: str, stop: list[str], stream: bool) -> dict:
        return {"model": stack.model_name, "prompt": prompt, "max_tokens": 40, "temperature": 0,
                "stop": stop, "stream": stream}

    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        unstopped = await asyncio.gather(*(_completion(client, {**body(p, [], False), "stop": None}) for p, _ in cases))
        streamed = await asyncio.gather(*(_completion(client, body(p, s, True)) for p, s in cases))
        full = await asyncio.gather(*(_completion(client, body(p, s, False)) for p, s in cases))
    for (prompt, stop), (free_text, _, _), got_stream, got_full in zip(cases, unstopped, streamed, full, strict=True):
        assert got_stream == got_full, (prompt, stop)
        text, finish, matched = got_full
        hits = [(free_text.find(s), s) for s in stop if free_text.find(s) >= 0]
        if hits:
            first, which = min(hits)
            assert (text, finish, matched) == (free_text[:first], "stop", which), (prompt, stop)
        else:
            assert text == free_text, (prompt, stop)
    stack.wait_idle()


async def test_concurrent_requests_batch_and_match_alone(stack):
    # 16 at once against each alone; 12 tokens each (the 16 alone are the test's cost: 192 steps).
    prompts = PROMPTS[:16]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as client:
        alone = [
            (await _full_text(client, _chat_body(stack.model_name, p, False, 12)))[0] for p in prompts
        ]
        before = stack.scheduler_load()
        results = await asyncio.gather(
            *(_stream_text(client, _chat_body(stack.model_name, p, True, 12)) for p in prompts)
        )
        after = stack.scheduler_load()
    assert [r[0] for r in results] == alone
    assert all(r[1] in ("stop", "length") for r in results)
    assert after.peak_decode_batch_size > 1
    assert after.num_finished_reqs - before.num_finished_reqs == 16
    stack.wait_idle()


async def test_closing_stream_aborts_and_frees_kv(stack):
    _, base_sched, _ = stack.wait_idle()
    body = {
        "model": stack.model_name,
        "messages": [{"role": "user", "content": "Write a very long story."}],
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen == 3:
                    break
            busy = stack.scheduler_load()
            assert busy.num_running_reqs == 1
            assert busy.kv_used_tokens > 0
    t0 = time.monotonic()
    tok, sched, detok = stack.wait_idle(timeout_s=5)
    assert time.monotonic() - t0 < 2.0
    assert sched.num_aborted_reqs == base_sched.num_aborted_reqs + 1
    assert sched.kv_used_tokens == base_sched.kv_used_tokens == 0
    # The next request is served normally.
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        text, _ = await _full_text(client, _chat_body(stack.model_name, "What is the capital of France?", False, 32))
    assert text == "The capital of France is Paris."


def test_grpc_client_sync_streams_chat(stack):
    with RingserveClient(stack.tokenizer) as client:
        chunks = list(
            client.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=32,
                        temperature=0.0)
        )
    assert "".join(c.text for c in chunks) == "The capital of France is Paris."
    assert chunks[-1].finish_reason == "stop"
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)


async def test_grpc_client_async_streams_chat(stack):
    async with AsyncRingserveClient(stack.tokenizer) as client:
        chunks = [
            c
            async for c in client.chat(
                [{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=32, temperature=0.0
            )
        ]
    assert "".join(c.text for c in chunks) == "The capital of France is Paris."
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].completion_tokens == sum(len(c.output_ids) for c in chunks)


def test_grpc_example_script(stack):
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "grpc_chat.py"), stack.tokenizer, "What is the capital of France?"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("The capital of France is Paris.") == 2
    assert out.stdout.count("[finish_reason=stop") == 2


SERVICES = {
    "tokenizer": "ringserve.v1.Tokenizer",
    "scheduler": "ringserve.v1.Scheduler",
    "detokenizer": "ringserve.v1.Detokenizer",
}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_health_and_reflection(stack, service):
    address = getattr(stack, service)
    with grpc.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICES[service]):
            resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        ask = iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        responses = list(refl.ServerReflectionInfo(ask, timeout=5))
    names = {s.name for s in responses[0].list_services_response.service}
    assert {SERVICES[service], "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_gateway_health_and_models(stack):
    assert httpx.get(f"{stack.base_url}/health", timeout=5).status_code == 200
    models = httpx.get(f"{stack.base_url}/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == [stack.model_name]


@pytest.mark.parametrize("sub", ["launch", "gateway", "tokenizer", "scheduler", "detokenizer", "prepare-model"])
def test_cli_help(sub):
    out = subprocess.run([sys.executable, "-m", "ringserve.cli", sub, "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: ringserve")
