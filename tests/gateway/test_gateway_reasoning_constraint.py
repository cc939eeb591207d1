"""An output constraint on a thinking request is marked to start after the reasoning's end
tag; with thinking off, or without a reasoning parser, it starts at the first token."""

from __future__ import annotations

CHAT = "/v1/chat/completions"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _body(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **extra,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}


async def test_the_grammar_starts_after_think_while_thinking(thinking, stack):
    for client, extra, want in ((thinking.client, {}, "</think>"),
                                (thinking.client, {"chat_template_kwargs": {"enable_thinking": False}}, ""),
                                (stack.client, {}, "")):
        thinking.fake.reset(thinking.out('{"a": 1}', finish="stop", completion=4))
        r = await client.post(CHAT, json=_body(thinking.model, **extra))
        assert r.status_code == 200, r.text
        c = thinking.fake.requests[0].sampling_params.constraint
        assert (c.param, c.starts_after) == ("response_format", want)
        assert c.json_schema  # the schema itself is unchanged
