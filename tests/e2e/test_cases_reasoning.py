"""Reasoning cases R01, R02 and R04 of ../shared/cases/CASES-structured.md through the ring,
with a second gateway started with ``--reasoning-parser deepseek_r1`` on the shared ring's
tokenizer (the parser is gateway work; R03, tags split across chunks, is checked over every
boundary in tests/gateway/test_output_parsers.py).

SmolLM2 does not think, and under deepseek_r1 everything before ``</think>`` is reasoning
(the opening tag may be in the prompt), so with thinking on its whole answer is reasoning:
enough to check where the text lands and that streamed and whole responses agree.
"""

from __future__ import annotations

import httpx
import pytest

from tests.ringstack import launched_gateway

from .structured_helpers import chat, chat_body, error_of


@pytest.fixture(scope="module")
def gateway(tools_ring):
    with launched_gateway(tools_ring.tokenizer, "--reasoning-parser", "deepseek_r1") as base:
        yield base


@pytest.fixture
async def client(gateway):
    async with httpx.AsyncClient(base_url=gateway, timeout=120) as c:
        yield c


async def test_r01_enable_thinking_false_answers_in_content(tools_ring, client):
    body = chat_body(tools_ring.model_name, "What is the capital of France?", max_tokens=16,
                     chat_template_kwargs={"enable_thinking": False})
    (plain,) = await chat(client, body, stream=False)
    (streamed,) = await chat(client, body, stream=True)
    assert plain.content and plain.reasoning is None
    assert (streamed.content, streamed.reasoning) == (plain.content, plain.reasoning)


async def test_r02_max_tokens_inside_the_reasoning_stays_reasoning(tools_ring, client):
    body = chat_body(tools_ring.model_name, "What is the capital of France?", max_tokens=5)
    (plain,) = await chat(client, body, stream=False)
    (streamed,) = await chat(client, body, stream=True)
    for msg in (plain, streamed):
        assert msg.finish_reason == "length" and not msg.content and msg.reasoning
    assert streamed.reasoning == plain.reasoning


async def test_r04_a_grammar_with_thinking_on_applies_only_after_the_reasoning(tools_ring, client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = chat_body(tools_ring.model_name, "Hi", max_tokens=12, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    (plain,) = await chat(client, body, stream=False)
    (streamed,) = await chat(client, body, stream=True)
    # SmolLM2 never writes </think>: all of it is reasoning, and the grammar never starts, so the
    # reasoning is exactly the unconstrained one (the grammar did not shape it).
    (free,) = await chat(client, {k: v for k, v in body.items() if k != "response_format"}, stream=False)
    assert free.reasoning and not free.content
    for msg in (plain, streamed):
        assert (msg.finish_reason, msg.content or "", msg.reasoning) == (free.finish_reason, "", free.reasoning)
    (msg,) = await chat(client, {**body, "max_tokens": 64, "chat_template_kwargs": {"enable_thinking": False}},
                        stream=False)
    assert msg.reasoning is None and isinstance(msg.content, str)
