"""Structured outputs and tool calls through the launched ring on SmolLM2: the S and T cases
of docs/cases.md that need no speculative decoding.

The ring is the default one (``stack``): its tokenizer renders with the shipped ChatML tools
template, chosen at start since SmolLM2's own ChatML template renders no tools, and the
gateway parses the model's own calls as hermes, the format the tokenizer reports.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from itertools import pairwise

import httpx
import jsonschema
import pytest

from tests.helpers.sse_reader import sse_events
from tests.helpers.structured import chat, chat_body, error_of

TOOL_W = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
TOOL_NESTED = {"type": "function", "function": {"name": "book_trip", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "dates": {"type": "object", "properties": {"from": {"type": "string"},
                                                                                "nights": {"type": "integer"}},
                                               "required": ["from", "nights"], "additionalProperties": False}},
    "required": ["city", "dates"], "additionalProperties": False}}}
TOOL_TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
SCHEMA_S06 = {"type": "object", "properties": {"guard": {"const": "SCHEMA_ENFORCED"}, "answer": {"type": "integer"}},
              "required": ["guard", "answer"], "additionalProperties": False}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
IPV4 = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def valid(text: str | None, schema: dict) -> object:
    value = json.loads(text)
    jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return value


@pytest.fixture
def ring(stack):
    return stack


@pytest.fixture
async def client(ring):
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=120) as c:
        yield c


async def alive(client: httpx.AsyncClient, model: str) -> None:
    resp = await client.post("/v1/chat/completions", json=chat_body(model, "Hi", max_tokens=8))
    assert resp.status_code == 200, resp.text
    assert (await client.get("/health")).status_code == 200


# ---- structured outputs ---------------------------------------------------------------

@pytest.mark.parametrize("constraint,param", [
    ({"structured_outputs": {"regex": "["}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
])
async def test_s01_bad_constraint_is_a_400_and_a_running_stream_finishes(ring, client, constraint, param):
    model = ring.model_name
    plain = asyncio.ensure_future(client.post("/v1/chat/completions", json=chat_body(
        model, "Count from one to ten in words.", max_tokens=40, stream=True)))
    await asyncio.sleep(0.3)
    for stream in (False, True):
        started = time.monotonic()
        error = await error_of(client, chat_body(model, "Hi", **constraint), stream)
        assert time.monotonic() - started < 1.0
        assert error["param"] == param and error["type"] == "invalid_request_error"
        assert error["message"].startswith(param + ":"), error
    resp = await plain
    events = sse_events(resp)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    await alive(client, model)
    ring.wait_idle()


@pytest.mark.parametrize("schema,reason", [
    ({"type": "object", "properties": 5}, "5 is not of type 'object'"),
    ({"$ref": "#/$defs/missing"}, "Pointer '/$defs/missing' does not exist"),
    ({"type": "strin"}, "not a valid JSON Schema"),
    ({"properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
     "oneOf at /properties/n is not provably exclusive: branches 0 and 1 (/properties/n/oneOf/0 and "
     "/properties/n/oneOf/1) may both match (both admit integers)"),
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
     "uniqueItems at /properties/tags is not supported"),
])
async def test_s03_invalid_or_unsupported_schema_is_a_400_naming_why(ring, client, schema, reason):
    for stream in (False, True):
        error = await error_of(client, chat_body(ring.model_name, "Hi", response_format=json_schema(schema)), stream)
        assert error["param"] == "response_format"
        assert reason in error["message"], error
    await alive(client, ring.model_name)


async def test_s03_format_email_is_enforced(ring, client):
    schema = {"type": "string", "format": "email", "maxLength": 40}
    body = chat_body(ring.model_name, "Write the email address of Ada, who works at example.com.",
                     response_format=json_schema(schema), max_tokens=48)
    (msg,) = await chat(client, body, stream=False)
    assert msg.finish_reason == "stop"
    assert "@" in valid(msg.content, schema)


PET = {"type": "object", "properties": {"pet": {"oneOf": [
    {"type": "object", "properties": {"kind": {"const": "cat"}, "name": {"type": "string", "maxLength": 16}},
     "required": ["kind", "name"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "dog"},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 30}},
     "required": ["kind", "age"], "additionalProperties": False}]}}, "required": ["pet"], "additionalProperties": False}
HOMEPAGE = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                             "homepage": {"type": "string", "format": "url", "maxLength": 32}},
            "required": ["name", "homepage"], "additionalProperties": False}


@pytest.mark.parametrize("schema,prompt", [(PET, "Describe a pet as JSON."),
                                           (HOMEPAGE, "Give a person's name and homepage as JSON.")])
async def test_s03_an_exclusive_one_of_and_an_unknown_format_are_answered_with_valid_json(ring, client, schema,
                                                                                         prompt):
    body = chat_body(ring.model_name, prompt, response_format=json_schema(schema), max_tokens=96)
    for (msg,) in await asyncio.gather(*(chat(client, body, stream) for stream in (False, True))):
        assert msg.finish_reason == "stop"
        valid(msg.content, schema)


def nested_one_of_defs(depth: int, keyword: str) -> dict:
    """Depth-``depth`` nesting of ``keyword`` through $defs (linear size, exponential to expand)."""
    defs = {"d0": {"type": "integer"}}
    for i in range(1, depth + 1):
        inner = {"$ref": f"#/$defs/d{i - 1}"}
        defs[f"d{i}"] = {keyword: [{"type": "object", "properties": {f"k{i}": inner}, "required": [f"k{i}"]},
                                   {"type": "array", "items": inner}]}
    return {"$defs": defs, "$ref": f"#/$defs/d{depth}"}


async def test_s05_a_heavy_grammar_never_stalls_the_server(ring, client):
    """Depth-16 nested oneOf/anyOf schemas sent while a plain stream runs and /health is
    polled every 100 ms. On a CPU two more rows in the batch lengthen every step whatever
    they carry, so the stream's largest gap is compared with the same two requests sent
    without a constraint (on a GPU that control is the solo stream)."""
    model = ring.model_name
    body = chat_body(model, "Count from one to twenty in words.", max_tokens=48, stream=True)

    async def largest_gap(during) -> tuple[float, list]:
        stamps = []

        async def read() -> None:
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        stamps.append(time.monotonic())

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0.3)
        results = await during()
        await reader
        return max(b - a for a, b in pairwise(stamps[1:])), results

    def send(constrained: bool):
        schemas = [nested_one_of_defs(16, "oneOf"), nested_one_of_defs(16, "anyOf")]
        return lambda: asyncio.gather(*(client.post("/v1/chat/completions", json=chat_body(
            model, "Hi", max_tokens=16, **({"response_format": json_schema(s)} if constrained else {})))
            for s in schemas))

    control, _ = await largest_gap(send(False))
    health: list[float] = []
    stop = asyncio.Event()

    async def poll() -> None:
        while not stop.is_set():
            t = time.monotonic()
            assert (await client.get("/health")).status_code == 200
            health.append(time.monotonic() - t)
            await asyncio.sleep(0.1)

    poller = asyncio.ensure_future(poll())
    started = time.monotonic()
    with_heavy, results = await largest_gap(send(True))
    took = time.monotonic() - started
    stop.set()
    await poller
    # llguidance builds the grammar lazily (the oneOf branches here are disjoint, so it is
    # exact): both are served, each mask computed as needed, with nothing compiled ahead.
    for resp in results:
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["finish_reason"] == "length"
    assert took < 5.0 + 10.0  # the compile budget (--grammar-compile-timeout 5) plus the stream
    health.sort()
    assert health[int(len(health) * 0.99)] < 1.0
    # A stall is a grammar compiled on the engine's or the tokenizer's loop: seconds (the compile
    # budget is 5 s). The 0.25 s beyond twice the control is scheduling noise on 2 shared cores
    # (`make test` runs the unit and model tiers beside this one): 0.146 s against a 0.073 s
    # control failed a bound of twice the control alone.
    assert with_heavy < 2 * control + 0.25, (with_heavy, control)


async def test_s06_schema_is_enforced_and_a_missing_schema_is_a_400(ring, client):
    prompt = "Answer in one English sentence: what is 19+4?"
    for stream in (False, True):
        (msg,) = await chat(client, chat_body(ring.model_name, prompt, response_format=json_schema(SCHEMA_S06)),
                            stream)
        assert valid(msg.content, SCHEMA_S06)["guard"] == "SCHEMA_ENFORCED"
        assert msg.finish_reason == "stop"
        fmt = {"type": "json_schema", "json_schema": {"name": "out", "strict": True}}
        error = await error_of(client, chat_body(ring.model_name, prompt, response_format=fmt), stream)
        assert error["message"] == "response_format.json_schema.schema is required"
        assert error["param"] == "response_format"


async def test_s10_constrained_generation_ends(ring, client):
    model = ring.model_name
    (msg,) = await chat(client, chat_body(model, "Tell me about cats.", response_format={"type": "json_object"},
                                          max_tokens=1024), stream=False)
    assert isinstance(json.loads(msg.content), dict) and msg.finish_reason == "stop"
    assert not re.search(r"\s{65}", msg.content)
    # (A prompt that invites a number can run to max_tokens on digits: a JSON number has no
    # length limit in the grammar, and SmolLM2 repeats "1" greedily; see docs/api.md.)
    (msg,) = await chat(client, chat_body(model, "Reply with a JSON value: the number of legs of a cat.",
                                          response_format=json_schema({}), max_tokens=128), False)
    json.loads(msg.content)
    assert msg.finish_reason == "stop"
    body = chat_body(model, "What is the IP address of the local host?", max_tokens=32,
                     structured_outputs={"regex": IPV4})
    for (msg,) in await asyncio.gather(*(chat(client, body, stream) for stream in (False, True))):
        assert re.fullmatch(IPV4, msg.content) and msg.finish_reason == "stop"
        assert msg.completion_tokens < 32


async def test_s12_constrained_and_plain_rows_in_one_batch(ring, client):
    model = ring.model_name
    plain = chat_body(model, "Repeat exactly: The quick brown fox jumps.", max_tokens=24)
    (solo,) = await chat(client, plain, stream=False)
    prompts = [f"Describe person number {i} as JSON." for i in range(8)]
    results = await asyncio.gather(
        *(chat(client, plain, stream=False) for _ in range(8)),
        *(chat(client, chat_body(model, p, response_format=json_schema(PERSON), max_tokens=64), False)
          for p in prompts))
    for (msg,) in results[:8]:
        assert msg.content == solo.content
    for (msg,) in results[8:]:
        valid(msg.content, PERSON)
        assert msg.finish_reason == "stop"
    ring.wait_idle()


async def test_s13_n_choices_each_have_their_own_matcher(ring, client):
    body = chat_body(ring.model_name, "Describe a person as JSON.", n=4, temperature=1.0, seed=7,
                     response_format=json_schema(PERSON), max_tokens=64)
    for messages in await asyncio.gather(*(chat(client, body, stream) for stream in (False, True))):
        assert len(messages) == 4
        for msg in messages:
            valid(msg.content, PERSON)


async def test_native_generate_and_completions_take_constraints(ring, client):
    resp = await client.post("/generate", json={"text": "The IP address of the local host is", "regex": IPV4,
                                                "sampling_params": {"temperature": 0, "max_new_tokens": 32}})
    assert resp.status_code == 200, resp.text
    assert re.fullmatch(IPV4, resp.json()["text"]) and resp.json()["meta_info"]["finish_reason"]["type"] == "stop"
    resp = await client.post("/generate", json={"text": "Yes or no?", "sampling_params": {
        "ebnf": 'root ::= "yes" | "no"', "temperature": 0, "max_new_tokens": 8}})
    assert resp.status_code == 200 and resp.json()["text"] in ("yes", "no")
    resp = await client.post("/generate", json={"text": "x", "regex": "a", "sampling_params": {"regex": "b"}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "sampling_params.regex"
    resp = await client.post("/v1/completions", json={"model": ring.model_name, "prompt": "Name a color:",
                                                      "structured_outputs": {"choice": ["red", "green", "blue"]},
                                                      "max_tokens": 8, "temperature": 0})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] in ("red", "green", "blue")
    resp = await client.post("/v1/completions", json={"model": ring.model_name, "prompt": "x",
                                                      "response_format": {"type": "text"}, "max_tokens": 2})
    assert resp.status_code == 200


async def test_abort_of_a_constrained_stream_releases_everything(ring, client):
    body = chat_body(ring.model_name, "Tell me about cats.", response_format={"type": "json_object"},
                     max_tokens=512, stream=True)
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                break
    ring.wait_idle()


# ---- tool calls -------------------------------------------------------------------------

@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
async def test_t01_t12_forced_calls_stream_with_names_first_and_parity(ring, client, tool_choice):
    body = chat_body(ring.model_name, "What is the weather in Paris for the next 3 days?", tools=[TOOL_W, TOOL_TIME],
                     tool_choice=tool_choice, max_tokens=96)
    (plain,) = await chat(client, body, stream=False)
    (streamed,) = await chat(client, body, stream=True)
    assert plain.finish_reason == streamed.finish_reason == "tool_calls"
    assert plain.content is None and streamed.content is None
    assert [(c["name"], c["arguments"]) for c in plain.tool_calls] == \
        [(c["name"], c["arguments"]) for c in streamed.tool_calls]
    assert plain.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(plain.args[0], TOOL_W["function"]["parameters"])


async def test_t02_last_property_integer_or_object_keeps_its_brace(ring, client):
    for tool in (TOOL_W, TOOL_NESTED):
        body = chat_body(ring.model_name, "Book a trip to Rome from May 3 for 2 nights and check the weather.",
                         tools=[tool], tool_choice={"type": "function", "function": {"name": tool["function"]["name"]}},
                         max_tokens=128)
        (plain,), (streamed,) = await asyncio.gather(chat(client, body, stream=False), chat(client, body, stream=True))
        assert streamed.args == plain.args
        assert streamed.tool_calls[0]["arguments"] == plain.tool_calls[0]["arguments"]
        jsonschema.validate(plain.args[0], tool["function"]["parameters"])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
async def test_t03_a_tool_without_parameters(ring, client, tool_choice):
    body = chat_body(ring.model_name, "What time is it?", tools=[TOOL_TIME], tool_choice=tool_choice, max_tokens=64)
    for (msg,) in await asyncio.gather(*(chat(client, body, stream) for stream in (False, True))):
        assert [(c["name"], json.loads(c["arguments"])) for c in msg.tool_calls] == [("get_time", {})]
        assert msg.completion_tokens < 32 and msg.finish_reason == "tool_calls"


async def test_t06_parallel_calls_have_their_own_indexes(ring, client):
    body = chat_body(ring.model_name, "Get weather for Paris, Rome and Oslo", tools=[TOOL_W], tool_choice="required",
                     max_tokens=200)
    (msg,) = await chat(client, body, stream=True)  # indexes 0..k-1, distinct ids: checked in chat()
    assert msg.tool_calls and all(c["name"] == "get_weather" for c in msg.tool_calls)
    for args in msg.args:
        jsonschema.validate(args, TOOL_W["function"]["parameters"])
    (single,) = await chat(client, {**body, "parallel_tool_calls": False}, stream=False)
    assert len(single.tool_calls) == 1


@pytest.mark.parametrize("tools,tool_choice,message", [
    ([], "required", 'tool_choice "required" needs at least one tool in tools'),
    ([TOOL_W], {"type": "function", "function": {"name": "get_time"}},
     "tool_choice names the function 'get_time', which is not in tools"),
    (None, "auto", "tool_choice is only allowed when tools are given"),
])
async def test_t09_impossible_tool_choices_are_a_400(ring, client, tools, tool_choice, message):
    body = chat_body(ring.model_name, "Hi", tool_choice=tool_choice, **({"tools": tools} if tools is not None else {}))
    for stream in (False, True):
        error = await error_of(client, body, stream)
        assert error["message"] == message and error["param"] == "tool_choice"


async def test_t09_required_with_chit_chat_still_calls(ring, client):
    body = chat_body(ring.model_name, "Hello! How are you today?", tools=[TOOL_W], tool_choice="required",
                     max_tokens=96)
    (msg,) = await chat(client, body, stream=False)
    assert len(msg.tool_calls) >= 1
    for args in msg.args:
        jsonschema.validate(args, TOOL_W["function"]["parameters"])


async def test_tool_results_render_through_the_template(ring, client):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]
    resp = await client.post("/v1/tokenize", json={"model": ring.model_name, "messages": messages, "tools": [TOOL_W]})
    assert resp.status_code == 200, resp.text
    prompt = resp.json()["prompt"]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}'
            '\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nSunny, 24 C\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in prompt
    assert '"name": "get_weather"' in prompt.split("<tools>\n")[1].split("</tools>")[0]
    (msg,) = await chat(client, chat_body(ring.model_name, messages, tools=[TOOL_W], tool_choice="none"), False)
    assert msg.content and msg.finish_reason in ("stop", "length") and not msg.tool_calls


def test_grpc_generate_takes_a_constraint_and_refuses_a_bad_one(ring):
    import grpc

    from ringserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

    def request(constraint: common_pb2.Constraint) -> tokenizer_pb2.GenerateReqInput:
        return tokenizer_pb2.GenerateReqInput(
            text="The IP address of the local host is",
            sampling_params=common_pb2.SamplingParams(temperature=0, max_new_tokens=32, constraint=constraint))

    with grpc.insecure_channel(ring.tokenizer) as ch:
        stub = tokenizer_pb2_grpc.TokenizerStub(ch)
        (out,) = list(stub.Generate(request(common_pb2.Constraint(regex=IPV4)), timeout=60))
        assert re.fullmatch(IPV4, out.text) and out.finish_reason.type == common_pb2.FINISH_STOP
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request(common_pb2.Constraint(regex="(a")), timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("regex: the constraint cannot be used")
        assert ("param", "regex") in tuple(info.value.trailing_metadata())


async def test_constraints_with_logprobs_and_stop_strings(ring, client):
    body = chat_body(ring.model_name, "Answer in one English sentence: what is 19+4?",
                     response_format=json_schema(SCHEMA_S06), logprobs=True, top_logprobs=2)
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    tokens = choice["logprobs"]["content"]
    assert "".join(t["token"] for t in tokens) == choice["message"]["content"]
    assert all(t["logprob"] <= 0 and len(t["top_logprobs"]) == 2 for t in tokens)
    valid(choice["message"]["content"], SCHEMA_S06)
    (msg,) = await chat(client, {**body, "logprobs": False, "top_logprobs": None, "stop": ["ENFORCED"]}, False)
    assert msg.finish_reason == "stop" and msg.content.endswith('"SCHEMA_')
