"""An output constraint on a thinking request is marked with the reasoning's tags (the
scheduler starts it at once unless the output opens with ``<think>``, then after
``</think>``), and under deepseek_r1 the tokenizer is asked whether the prompt opened the
reasoning; with thinking off, or without a reasoning parser, nothing is marked."""

from __future__ import annotations

CHAT = "/v1/chat/completions"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _body(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **extra,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}


async def test_a_thinking_request_carries_the_reasoning_tags(thinking, stack):
    for client, extra, want in ((thinking.client, {}, ("<think>", "</think>", "<think>")),
                                (thinking.client, {"chat_template_kwargs": {"enable_thinking": False}}, ("", "", "")),
                                (stack.client, {}, ("", "", ""))):
        thinking.fake.reset(thinking.out('{"a": 1}', finish="stop", completion=4))
        r = await client.post(CHAT, json=_body(thinking.model, **extra))
        assert r.status_code == 200, r.text
        sent = thinking.fake.requests[0]
        c = sent.sampling_params.constraint
        assert (c.param, c.opens_with, c.starts_after, sent.chat.reasoning_start) == ("response_format", *want)
        assert c.json_schema  # the schema itself is unchanged
