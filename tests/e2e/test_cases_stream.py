"""Cases C06 and C07 of docs/cases.md: chunk schema, finish_reason, usage chunk
and SSE framing, checked on every chunk of real streams (framing byte for byte in
``sse_reader.sse_events``), each against the same request not streamed.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.helpers.sse_reader import call

FINISH_REASONS = {"stop", "length", "tool_calls"}


def check_chunks(events: list[dict], model: str, n: int, include_usage: bool, chat: bool) -> dict | None:
    """Assert the chunk schema of one stream of ``n`` choices; return its usage chunk's usage."""
    obj, prefix = ("chat.completion.chunk", "chatcmpl-") if chat else ("text_completion", "cmpl-")
    head = {k: events[0][k] for k in ("id", "created", "model")}
    assert head["id"].startswith(prefix) and head["model"] == model and isinstance(head["created"], int)
    usage_chunks = [e for e in events if not e["choices"]]
    content = [e for e in events if e["choices"]]
    assert len(usage_chunks) == (1 if include_usage else 0)
    if include_usage:
        assert events[-1] is usage_chunks[0]  # after every finish chunk
    seen: dict[int, int] = {}  # choice index -> chunks so far
    finished: dict[int, str] = {}
    for e in events:
        assert e["object"] == obj and {k: e[k] for k in head} == head, e
        assert "usage" in e
    for e in content:
        assert e["usage"] is None, e  # content chunks carry usage: null
        for c in e["choices"]:
            i = c["index"]
            assert "finish_reason" in c and i not in finished, (e, finished)
            if chat:
                # The first delta of a choice carries the role, later ones do not.
                assert ("role" in c["delta"]) == (i not in seen), e
                assert c["delta"].get("role", "assistant") == "assistant"
            seen[i] = seen.get(i, 0) + 1
            if c["finish_reason"] is not None:
                assert c["finish_reason"] in FINISH_REASONS, c  # never "" or another value
                finished[i] = c["finish_reason"]
    assert sorted(seen) == sorted(finished) == list(range(n))
    if not include_usage:
        return None
    usage = usage_chunks[0]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    return usage




COUNT, HI = "Count from 1 to 100.", "Say hi."
WITH_USAGE = {"stream_options": {"include_usage": True}}
VARIANTS = [  # (id, content, max_tokens, extra fields, n, expected finish_reason)
    ("c06a", COUNT, 5, {}, 1, "length"),
    ("c06b", HI, 200, {}, 1, "stop"),
    ("c07a", COUNT, 5, WITH_USAGE, 1, "length"),
    ("c07c", COUNT, 5, {**WITH_USAGE, "n": 2}, 2, "length"),
    ("c07a-hi", HI, 200, WITH_USAGE, 1, "stop"),
    ("c07c-hi", HI, 200, {**WITH_USAGE, "n": 2}, 2, "stop"),
]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
async def test_c06_c07_chunk_schema_usage_and_framing(stack, chat):
    def prompt(content: str) -> dict:
        return {"messages": [{"role": "user", "content": content}]} if chat else {"prompt": content}

    def body(content: str, max_tokens: int, extra: dict, stream: bool = True) -> dict:
        if not stream:
            extra = {k: v for k, v in extra.items() if k != "stream_options"}
        return {"model": stack.model_name, **prompt(content), "stream": stream, "max_tokens": max_tokens,
                "temperature": 0, **extra}

    # C06 is about chat chunks; completions streams share the C07 rules (its "Say hi." has
    # no end of turn to stop at, so only the length variants run there).
    variants = VARIANTS if chat else [v for v in VARIANTS if v[1] == COUNT]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
        streamed = await asyncio.gather(*(call(client, body(c, m, x)) for _, c, m, x, _, _ in variants))
        full = await asyncio.gather(*(call(client, body(c, m, x, False)) for _, c, m, x, _, _ in variants))
        prompts = {}
        for content in (COUNT, HI):
            resp = await client.post("/v1/tokenize", json={"model": stack.model_name, **prompt(content)})
            prompts[content] = resp.json()["count"]
    for (name, content, max_tokens, extra, n, finish), got, want in zip(variants, streamed, full, strict=True):
        usage = check_chunks(got.events, stack.model_name, n, "stream_options" in extra, chat)
        assert sorted(got.choices) == list(range(n)), name
        for i in range(n):
            assert got.choices[i].finish_reason == want.choices[i].finish_reason == finish, name
            assert got.choices[i].text == want.choices[i].text, name
        # temperature 0: every choice is the same greedy answer
        assert len({c.text for c in got.choices.values()}) == 1, name
        assert want.usage["prompt_tokens"] == prompts[content], name
        if finish == "length":
            assert want.usage["completion_tokens"] == n * max_tokens, name
        if usage is not None:
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
                want.usage["prompt_tokens"], want.usage["completion_tokens"]), name
    stack.wait_idle()
