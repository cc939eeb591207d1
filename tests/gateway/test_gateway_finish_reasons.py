"""What the gateway reports for a choice's text, against a scripted tokenizer: finish
reasons that tell the truth (a call cut by max_tokens is "length", "tool_calls" only with a
named call), text never dropped, tool calls inside the reasoning left as reasoning, where
the reasoning is (the prompt may open it under deepseek_r1), and strict schemas closed."""

from __future__ import annotations

import json

import orjson
import pytest

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = "/v1/chat/completions"
TOOL_W = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def _body(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Weather in Paris?"}], **extra}


async def _both(stack, body: dict, chunks: list[str], finish: str, reasoning_open: bool = False) -> list[dict]:
    """The non-streamed message (the tokenizer sends the whole text once) and the streamed one
    (``chunks`` as deltas) joined, each as {content, reasoning, calls [(name, arguments)], finish}."""
    got = []
    for stream in (False, True):
        texts = chunks if stream else ["".join(chunks)]
        outputs = [stack.out(t, finish=finish if i == len(texts) - 1 else None, completion=i + 1)
                   for i, t in enumerate(texts)]
        for out in outputs:
            out.reasoning_open = reasoning_open
        stack.fake.reset(*outputs)
        r = await stack.client.post(CHAT, json={**body, "stream": stream})
        assert r.status_code == 200, r.text
        if not stream:
            choice = r.json()["choices"][0]
            m = choice["message"]
            calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"] or []]
            got.append({"content": m["content"], "reasoning": m.get("reasoning_content"), "calls": calls,
                        "finish": choice["finish_reason"]})
            continue
        content, reasoning, calls, finish = "", "", {}, None
        for line in r.content.split(b"\n\n"):
            if not line.startswith(b"data: {"):
                continue
            for c in orjson.loads(line[6:])["choices"]:
                d = c["delta"]
                content += d.get("content") or ""
                reasoning += d.get("reasoning_content") or ""
                for tc in d.get("tool_calls") or []:
                    name, args = calls.get(tc["index"], (tc["function"].get("name"), ""))
                    calls[tc["index"]] = (name, args + tc["function"]["arguments"])
                finish = c["finish_reason"] or finish
        got.append({"content": content or None, "reasoning": reasoning or None,
                    "calls": [calls[i] for i in sorted(calls)], "finish": finish})
    return got


async def test_a_forced_call_cut_by_max_tokens_finishes_length_with_its_arguments_so_far(stack):
    body = _body(stack.model, tools=[TOOL_W], tool_choice="required", max_tokens=14)
    cut = await _both(stack, body, ['[{"name": "get_weather", ', '"arguments": {"city": "Par'], "length")
    want = {"content": None, "reasoning": None, "calls": [("get_weather", '{"city": "Par')], "finish": "length"}
    assert cut == [want, want]
    # Cut before the call has a name: no call, and the text is content, not dropped.
    nameless = await _both(stack, body, ['[{', '"na'], "length")
    want = {"content": '[{"na', "reasoning": None, "calls": [], "finish": "length"}
    assert nameless == [want, want]
    # Whole: "tool_calls".
    whole = await _both(stack, body, ['[{"name": "get_weather", "arguments": {"city": "Paris"}}]'], "stop")
    assert [m["finish"] for m in whole] == ["tool_calls", "tool_calls"]


async def test_a_model_call_cut_by_max_tokens_finishes_length(stack):
    body = _body(stack.model, tools=[TOOL_W], max_tokens=12)
    got = await _both(stack, body, ["Let me look. <tool", '_call>{"name": "get_weather", "arguments": {"ci'], "length")
    want = {"content": "Let me look. ", "reasoning": None, "calls": [("get_weather", '{"ci')], "finish": "length"}
    assert got == [want, want]


async def test_a_tool_call_inside_the_reasoning_stays_reasoning(thinking):
    body = _body(thinking.model, tools=[TOOL_W])
    got = await _both(thinking, body, [f"<think>I could call {CALL} here.</think>", "It is sunny."], "stop")
    want = {"content": "It is sunny.", "reasoning": f"I could call {CALL} here.", "calls": [], "finish": "stop"}
    assert got == [want, want]
    after = await _both(thinking, body, [f"<think>Call it.</think>{CALL}"], "stop")
    assert [(m["reasoning"], m["calls"], m["finish"]) for m in after] == \
        [("Call it.", [("get_weather", '{"city": "Paris"}')], "tool_calls")] * 2


async def test_deepseek_r1_reads_the_reasoning_from_the_prompt_or_the_output(thinking):
    body = _body(thinking.model)
    # The tokenizer saw the rendered prompt end with <think>.
    assert await _both(thinking, body, ["The user asks.</thi", "nk>Paris."], "stop", reasoning_open=True) == \
        [{"content": "Paris.", "reasoning": "The user asks.", "calls": [], "finish": "stop"}] * 2
    # Not opened by the prompt, and the output does not open with <think>: an answer.
    assert await _both(thinking, body, ["Paris.</think>"], "stop") == \
        [{"content": "Paris.</think>", "reasoning": None, "calls": [], "finish": "stop"}] * 2
    assert await _both(thinking, body, ["<think>Hm.</think>Paris."], "stop") == \
        [{"content": "Paris.", "reasoning": "Hm.", "calls": [], "finish": "stop"}] * 2


SCHEMA = {"type": "object", "properties": {
    "city": {"type": "object", "properties": {"name": {"type": "string"}}},
    "tags": {"type": "array", "items": {"type": "object", "properties": {"t": {"const": {"type": "object"}}}}},
    "both": {"allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"b": {"type": "string"}}}]},
    "open": {"type": "object", "additionalProperties": True}}, "$defs": {"d": {"type": "object"}}}


def _closed(strict: bool) -> dict:
    s = json.loads(json.dumps(SCHEMA))
    if strict:
        for node in (s, s["properties"]["city"], s["properties"]["tags"]["items"], s["$defs"]["d"]):
            node["additionalProperties"] = False
    return s


@pytest.mark.parametrize("strict", [True, False, None])
async def test_strict_closes_every_object_schema_that_omits_additional_properties(stack, strict):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    if strict is not None:
        fmt["json_schema"]["strict"] = strict
    stack.fake.reset(stack.out("{}", finish="stop"))
    r = await stack.client.post(CHAT, json=_body(stack.model, response_format=fmt))
    assert r.status_code == 200, r.text
    assert json.loads(stack.fake.requests[0].sampling_params.constraint.json_schema) == _closed(strict is True)


async def test_a_strict_forced_tool_has_closed_arguments(stack):
    tool = {"type": "function", "function": {**TOOL_W["function"], "strict": True}}
    stack.fake.reset(stack.out('[{"name": "get_weather", "arguments": {"city": "P"}}]', finish="stop"))
    r = await stack.client.post(CHAT, json=_body(stack.model, tools=[tool], tool_choice="required"))
    assert r.status_code == 200, r.text
    schema = json.loads(stack.fake.requests[0].sampling_params.constraint.json_schema)
    assert schema["items"]["properties"]["arguments"] == {**TOOL_W["function"]["parameters"],
                                                          "additionalProperties": False}
    rendered = orjson.loads(stack.fake.requests[0].chat.tools_json)
    assert rendered[0]["function"]["parameters"] == TOOL_W["function"]["parameters"]  # the prompt shows them as given
