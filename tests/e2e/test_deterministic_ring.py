"""Deterministic inference through the whole ring, as a user meets it: the default
ring on the CPU (bf16, no flag) gives a greedy request the same text streamed and not
streamed, whichever of the two ran first and so found the other's prompt in the prefix
cache. Before deterministic inference this failed for 2 of 5 short prompts tried one after
the other (the cached run prefills only the last token, in other arithmetic). The ring is
``tls_ring`` (tests/e2e/conftest.py), which test_reliability_tls.py shares."""

from __future__ import annotations

import asyncio

import httpx

from tests.helpers.sse_reader import call

PROMPTS = ["How much does a good bicycle cost?", "Name a famous bridge.", "What is the capital of Peru?",
           "What do bees make?", "Why is the sea salty?", "Write a haiku about autumn."]


def test_streamed_and_not_streamed_agree_whichever_hits_the_cache(tls_ring):
    ring = tls_ring  # bf16, no flag about determinism (its TLS between services changes no arithmetic)

    async def run() -> list[tuple[str, str, str]]:
        async with httpx.AsyncClient(base_url=ring.base_url, timeout=120) as client:
            out = []
            for i, prompt in enumerate(PROMPTS):
                body = {"model": ring.model_name, "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": 24, "temperature": 0}
                first, second = (True, False) if i % 2 == 0 else (False, True)  # either order
                a = await call(client, {**body, "stream": first, "stream_options": {"include_usage": True}} if first
                               else {**body, "stream": False})
                b = await call(client, {**body, "stream": second, "stream_options": {"include_usage": True}} if second
                               else {**body, "stream": False})
                assert a.usage["prompt_tokens"] == b.usage["prompt_tokens"]
                assert a.usage["completion_tokens"] == b.usage["completion_tokens"]
                assert b.usage["prompt_tokens_details"]["cached_tokens"] == b.usage["prompt_tokens"] - 1
                out.append((prompt, a.only.text, b.only.text))
            return out

    for prompt, first, second in asyncio.run(run()):
        assert first == second, prompt
    assert "deterministic inference on" in ring.log()
