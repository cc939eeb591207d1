"""Reasoning through the ring, with gateways started with ``--reasoning-parser deepseek_r1``
and ``qwen3`` on the default ring's tokenizer (``stack``) (the parsers are gateway work; tags split
across chunks are checked over every boundary in tests/gateway/test_output_parsers.py).

SmolLM2 does not think. So its answers show what a reasoning model's non-thinking answers
get: content, and a grammar from the first token (the scheduler starts it at once unless
the output opens with ``<think>``). Its reasoning is made by continuing an assistant
message that opens ``<think>``: under deepseek_r1 a prompt that ends with the tag opens the
reasoning (as DeepSeek-R1's template does), so everything SmolLM2 then writes is reasoning.
Cases R01, R02 and R04 of the field failures; the grammar cases are the ones an outside
battery found unenforced.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from tests.helpers.ringstack import launched_gateway
from tests.helpers.structured import chat, chat_body

SCHEMA_S06 = {"type": "object", "properties": {"guard": {"const": "SCHEMA_ENFORCED"}, "answer": {"type": "integer"}},
              "required": ["guard", "answer"], "additionalProperties": False}
TOOL_W = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
THINKING = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                         {"role": "assistant", "content": "<think>\n"}],
            "continue_final_message": True, "add_generation_prompt": False}


@pytest.fixture(scope="module")
def gateways(stack):
    with launched_gateway(stack.tokenizer, "--reasoning-parser", "deepseek_r1") as r1, \
            launched_gateway(stack.tokenizer, "--reasoning-parser", "qwen3") as qwen3:
        yield {"deepseek_r1": r1, "qwen3": qwen3}


@pytest.fixture
async def client(gateways):
    async with httpx.AsyncClient(base_url=gateways["deepseek_r1"], timeout=120) as c:
        yield c


@pytest.fixture
async def qwen3_client(gateways):
    async with httpx.AsyncClient(base_url=gateways["qwen3"], timeout=120) as c:
        yield c


async def test_r01_enable_thinking_false_answers_in_content(stack, client):
    body = chat_body(stack.model_name, "What is the capital of France?", max_tokens=16,
                     chat_template_kwargs={"enable_thinking": False})
    (plain,) = await chat(client, body, stream=False)
    (streamed,) = await chat(client, body, stream=True)
    assert plain.content and plain.reasoning is None
    assert (streamed.content, streamed.reasoning) == (plain.content, plain.reasoning)


async def test_r02_max_tokens_inside_the_reasoning_stays_reasoning(stack, client):
    body = {**chat_body(stack.model_name, THINKING["messages"], max_tokens=5), **THINKING}
    (plain,) = await chat(client, body, stream=False)
    (streamed,) = await chat(client, body, stream=True)
    for msg in (plain, streamed):
        assert msg.finish_reason == "length" and not msg.content and msg.reasoning
    assert streamed.reasoning == plain.reasoning


async def test_r04_a_grammar_with_thinking_on_applies_only_after_the_reasoning(stack, client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {**chat_body(stack.model_name, THINKING["messages"], max_tokens=12, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}), **THINKING}
    (plain,) = await chat(client, body, stream=False)
    (streamed,) = await chat(client, body, stream=True)
    # The prompt opened the reasoning and SmolLM2 never writes </think>: all of it is reasoning,
    # and the grammar never starts, so the reasoning is exactly the unconstrained one.
    (free,) = await chat(client, {k: v for k, v in body.items() if k != "response_format"}, stream=False)
    assert free.reasoning and not free.content
    for msg in (plain, streamed):
        assert (msg.finish_reason, msg.content or "", msg.reasoning) == (free.finish_reason, "", free.reasoning)
    (msg,) = await chat(client, {**body, "max_tokens": 64, "chat_template_kwargs": {"enable_thinking": False}},
                        stream=False)
    assert msg.reasoning is None and isinstance(msg.content, str)


async def test_an_answer_without_a_think_block_gets_its_schema_enforced(stack, qwen3_client):
    body = chat_body(stack.model_name, "Answer in one English sentence: what is 19+4?", max_tokens=48,
                     response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA_S06}})
    for (msg,) in await asyncio.gather(*(chat(qwen3_client, body, stream) for stream in (False, True))):
        value = json.loads(msg.content)
        jsonschema.validate(value, SCHEMA_S06)
        assert (value["guard"], msg.reasoning, msg.finish_reason) == ("SCHEMA_ENFORCED", None, "stop")


@pytest.mark.parametrize("parser,tool_choice", [
    ("qwen3", "required"), ("deepseek_r1", {"type": "function", "function": {"name": "get_weather"}})])
async def test_an_answer_without_a_think_block_makes_the_forced_call(stack, gateways, parser, tool_choice):
    body = chat_body(stack.model_name, "What is the weather in Paris for the next 3 days?", tools=[TOOL_W],
                     tool_choice=tool_choice, max_tokens=48)
    async with httpx.AsyncClient(base_url=gateways[parser], timeout=120) as client:
        for (msg,) in await asyncio.gather(*(chat(client, body, stream) for stream in (False, True))):
            assert [c["name"] for c in msg.tool_calls] == ["get_weather"], msg
            jsonschema.validate(msg.args[0], TOOL_W["function"]["parameters"])
            assert (msg.finish_reason, msg.content, msg.reasoning) == ("tool_calls", None, None)
    stack.wait_idle()
