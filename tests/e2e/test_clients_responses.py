"""/v1/responses through the ring, driven by the client libraries as their users call them:
the openai SDK's ``responses.create`` and ``responses.stream`` (a text answer, a forced tool
call, a tool loop over ``previous_response_id``; each streamed final response equal to the
non-streamed one) and the OpenAI Agents SDK in its default (Responses) mode running an agent
with one function tool to a final answer.

On the shared default ring (``stack``: SmolLM2, whose template renders no tools, so the
tokenizer serves it with ringserve/templates/chatml_tools.jinja and the gateway parses hermes).
SmolLM2-135M is tiny, so a call is made deterministic by forcing it (tool_choice) and decoding
greedily; what is asserted is the structure, exactly.
"""

from __future__ import annotations

import json

import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

from tests.helpers.responses_events import WEATHER, normalized

QUESTION = "What is the weather in Paris?"


@pytest.fixture
async def sdk(stack):
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    yield client
    await client.close()


def _comparable(response: dict) -> dict:
    """``normalized``, without what differs by design between two calls of one request: the
    prompt tokens the second found in the prefix cache, and the SDK's own ``parsed`` fields."""
    out = normalized(response)
    out["usage"]["input_tokens_details"]["cached_tokens"] = 0
    for item in out["output"]:
        item.pop("parsed_arguments", None)
        for part in item.get("content") or ():
            part.pop("parsed", None)
    return out


async def _create_and_stream(sdk, **params) -> dict:
    """The non-streamed response; the streamed one's final response equals it (ids, times and
    cache hits aside)."""
    whole = (await sdk.responses.create(**params)).model_dump(mode="json", exclude_unset=True)
    async with sdk.responses.stream(**params) as stream:
        types = [event.type async for event in stream]
        final = (await stream.get_final_response()).model_dump(mode="json", exclude_unset=True)
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == f"response.{whole['status']}"
    assert _comparable(final) == _comparable(whole)
    return whole


async def test_a_text_answer(stack, sdk):
    r = await _create_and_stream(sdk, model=stack.model_name, input="What is the capital of France?",
                                 instructions="Answer in one sentence.", temperature=0, max_output_tokens=12)
    assert r["status"] in ("completed", "incomplete")
    (message,) = r["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["type"] == "output_text" and message["content"][0]["text"].strip()
    usage = r["usage"]
    assert 0 < usage["output_tokens"] <= 12 and usage["input_tokens"] > 10
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
    if r["status"] == "incomplete":
        assert usage["output_tokens"] == 12 and r["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_a_forced_tool_call_then_its_result(stack, sdk):
    params = {"model": stack.model_name, "tools": [WEATHER], "temperature": 0, "max_output_tokens": 40}
    r = await _create_and_stream(sdk, **params, input=QUESTION, tool_choice={"type": "function", "name": "get_weather"})
    assert r["status"] == "completed"
    (call,) = r["output"]
    assert set(call) == {"id", "type", "call_id", "name", "arguments", "status"}
    assert (call["type"], call["name"], call["status"]) == ("function_call", "get_weather", "completed")
    arguments = json.loads(call["arguments"])
    assert isinstance(arguments, dict) and isinstance(arguments["city"], str)
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny, 18 C"}
    answer = await sdk.responses.create(**params, input=[result], previous_response_id=r["id"], tool_choice="none")
    assert answer.previous_response_id == r["id"] and answer.output[0].type == "message"
    assert answer.output_text.strip()
    stored = (await sdk.responses.retrieve(r["id"])).model_dump(mode="json", exclude_unset=True)
    assert stored == r


async def test_the_agents_sdk_runs_an_agent_with_a_tool_to_a_final_answer(stack, sdk):
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: The city's name.
        """
        calls.append(city)
        return f"The weather in {city} is sunny and 18 C."  # a sentence SmolLM2 then repeats (greedy)

    set_tracing_disabled(True)
    agent = Agent(
        name="weather", instructions="Answer with the weather the tool gives.", tools=[get_weather],
        model=OpenAIResponsesModel(model=stack.model_name, openai_client=sdk),
        # The first turn must call the tool; after it the Agent resets tool_choice (its default)
        # so that the second turn can answer.
        model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60),
    )
    result = await Runner.run(agent, QUESTION, max_turns=3)
    assert len(calls) == 1 and calls[0]
    assert isinstance(result.final_output, str) and result.final_output.strip()
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
