"""Cases C09, C10 and C11 of docs/cases.md (content parts, continuing the final
assistant message, system messages) and n with a seed, through the stack.

The rendered prompt is read through ``POST /v1/tokenize`` with the same messages, so each
check compares the prompt the model saw, not only its answer.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.helpers.sse_reader import Result, call


def parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


async def tokenize(client: httpx.AsyncClient, model: str, messages: list[dict], **flags) -> dict:
    resp = await client.post("/v1/tokenize", json={"model": model, "messages": messages, **flags})
    assert resp.status_code == 200, resp.text
    return resp.json()


def chat(model: str, messages: list[dict], stream: bool, max_tokens: int = 20, **extra) -> dict:
    return {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens,
            "stream": stream, **extra}


def answer(result: Result) -> tuple[str, str | None]:
    return result.only.text, result.only.finish_reason


async def both(client: httpx.AsyncClient, body: dict) -> tuple[Result, Result]:
    """The same request not streamed and streamed."""
    return await asyncio.gather(call(client, {**body, "stream": False}), call(client, {**body, "stream": True}))


# --- C09: content as a list of parts ---------------------------------------------------------

C09 = [
    {"role": "system", "content": parts("You are terse.")},
    {"role": "user", "content": parts("What is 2+", "2? Answer with one digit.")},
]
WEATHER_CALL = {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
EVERY_ROLE = [  # (role, text, extra fields)
    ("system", "You are terse.", {}),
    ("developer", "Answer in one sentence.", {}),
    ("user", "What is the weather in Paris?", {}),
    ("assistant", "Let me check.", {"tool_calls": [WEATHER_CALL]}),
    ("tool", "Sunny, 21 C.", {"tool_call_id": "call_1"}),
]


async def test_c09_text_parts_on_every_role(stack):
    model = stack.model_name
    as_parts = [{"role": r, "content": parts(t), **x} for r, t, x in EVERY_ROLE]
    as_strings = [{"role": r, "content": t, **x} for r, t, x in EVERY_ROLE]
    joined = [C09[0], {"role": "user", "content": "What is 2+2? Answer with one digit."}]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
        runs = await asyncio.gather(*(both(client, chat(model, m, False)) for m in (C09, joined, as_parts, as_strings)))
        prompts = await asyncio.gather(*(tokenize(client, model, m) for m in (C09, joined, as_parts, as_strings)))
    (c09, c09_stream), (str_, str_stream), (roles, roles_stream), (roles_str, roles_str_stream) = runs
    # Parts are joined with no separator: the case's two parts are the one string.
    assert "<|im_start|>user\nWhat is 2+2? Answer with one digit.<|im_end|>" in prompts[0]["prompt"]
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3]
    for _, text, _ in EVERY_ROLE:
        assert prompts[2]["prompt"].count(text) == 1
    # Single-part content gives the same prompt tokens and output as the string form.
    for got, want in ((c09, str_), (roles, roles_str)):
        assert answer(got) == answer(want) and got.usage == want.usage
    for streamed, full in ((c09_stream, c09), (str_stream, str_), (roles_stream, roles), (roles_str_stream, roles_str)):
        assert answer(streamed) == answer(full) and answer(full)[0]
    assert c09.usage["prompt_tokens"] == prompts[0]["count"]
    assert roles.usage["prompt_tokens"] == prompts[2]["count"]
    stack.wait_idle()


UNSUPPORTED = [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
]


@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool"])
async def test_c09_unsupported_part_is_400(stack, role):
    extra = {"tool_call_id": "call_1"} if role == "tool" else {}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        resps = []
        for part in UNSUPPORTED:
            messages = [{"role": "user", "content": "Describe it."},
                        {"role": role, "content": [*parts("Look:"), part], **extra}]
            for stream in (False, True):
                resps.append(await client.post("/v1/chat/completions", json=chat(stack.model_name, messages, stream)))
            resps.append(await client.post("/v1/tokenize", json={"model": stack.model_name, "messages": messages}))
    for resp in resps:
        assert resp.status_code == 400, resp.text
        assert resp.headers["content-type"] == "application/json"
        err = resp.json()["error"]
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", "messages",
                                                           "unsupported_content_type"), err
        assert "messages[1].content[1]" in err["message"], err
    stack.wait_idle()


# --- C10: continuing the final assistant message ------------------------------------------

QUESTION = {"role": "user", "content": "Complete the sentence."}
PREFILLS = ["The capital of France is", "The capital of France is ", "Paris is the capital of\n"]


async def test_c10_continue_final_message(stack):
    model = stack.model_name
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
        for prefill in PREFILLS:
            messages = [QUESTION, {"role": "assistant", "content": prefill}]
            rendered = await tokenize(client, model, messages, **flags)
            header = await tokenize(client, model, [QUESTION])  # up to the new assistant header
            # The prompt ends with the prefill: no end-of-turn token, no new assistant header.
            assert rendered["prompt"] == header["prompt"] + prefill, prefill
            (plain, plain_stream), (echo, echo_stream), reference = await asyncio.gather(
                both(client, chat(model, messages, False, **flags)),
                both(client, chat(model, messages, False, echo=True, **flags)),
                # The same prompt ids as a completion: exactly the continuation.
                call(client, {"model": model, "prompt": rendered["tokens"], "max_tokens": 20, "temperature": 0}),
            )
            continuation = reference.only.text
            assert continuation and prefill not in continuation
            for got in (plain, plain_stream):
                assert answer(got) == (continuation, reference.only.finish_reason), prefill
            for got in (echo, echo_stream):
                assert answer(got) == (prefill + continuation, reference.only.finish_reason), prefill
            assert plain.usage["prompt_tokens"] == echo.usage["prompt_tokens"] == rendered["count"]
            assert plain_stream.events[0]["choices"][0]["delta"]["role"] == "assistant"
    stack.wait_idle()


async def test_c10_conflicting_flags_are_400(stack):
    model = stack.model_name
    prefilled = [QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    conflicts = [  # (messages, flags)
        (prefilled, {"add_generation_prompt": True, "continue_final_message": True}),
        ([QUESTION], {"add_generation_prompt": False, "continue_final_message": True}),
        ([QUESTION], {"continue_final_message": True}),
        ([prefilled[1], QUESTION], {"continue_final_message": True}),
    ]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        resps = []
        for messages, flags in conflicts:
            for stream in (False, True):
                resps.append(await client.post("/v1/chat/completions", json=chat(model, messages, stream, **flags)))
            resps.append(await client.post("/v1/tokenize", json={"model": model, "messages": messages, **flags}))
    for resp in resps:
        assert resp.status_code == 400, resp.text
        assert resp.headers["content-type"] == "application/json"
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "continue_final_message", err
    stack.wait_idle()


# --- C11: system messages are never dropped -------------------------------------------------

SYSTEM = "Always answer in French."
SKY = {"role": "user", "content": "What colour is the sky?"}


@pytest.mark.parametrize("form", ["string", "parts"])
async def test_c11_system_message_is_never_dropped(stack, form):
    model = stack.model_name
    content = SYSTEM if form == "string" else parts("Always answer", " in French.")
    with_system = [{"role": "system", "content": content}, SKY]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
        rendered, empty, alone, system_only = await asyncio.gather(
            tokenize(client, model, with_system),
            tokenize(client, model, [{"role": "system", "content": ""}, SKY]),
            tokenize(client, model, [SKY]),
            client.post("/v1/tokenize", json={"model": model, "prompt": SYSTEM, "add_special_tokens": False}),
        )
        (full, streamed), (plain, _) = await asyncio.gather(
            both(client, chat(model, with_system, False, max_tokens=30)),
            both(client, chat(model, [SKY], False, max_tokens=30)),
        )
    system_tokens = system_only.json()["count"]
    prompt = rendered["prompt"]
    # The system text is in the template's system slot, once: the prompt is the one with an
    # empty system message with the text inserted there, before the user's turn.
    slot = next(i for i, (a, b) in enumerate(zip(prompt, empty["prompt"], strict=False)) if a != b)
    assert prompt == empty["prompt"][:slot] + SYSTEM + empty["prompt"][slot:]
    assert prompt.count(SYSTEM) == 1 and slot < prompt.index(SKY["content"])
    assert rendered["count"] - empty["count"] == system_tokens
    # Without any system message this template inserts its default one in the same slot;
    # the client's system text replaces it, so the counts differ by the two texts' lengths.
    default = alone["prompt"][slot : len(alone["prompt"]) - len(empty["prompt"]) + slot]
    assert alone["prompt"] == empty["prompt"][:slot] + default + empty["prompt"][slot:]
    assert SYSTEM not in alone["prompt"]
    default_tokens = alone["count"] - empty["count"]
    assert default_tokens > 0 and rendered["count"] - alone["count"] == system_tokens - default_tokens
    assert full.usage["prompt_tokens"] == rendered["count"] and plain.usage["prompt_tokens"] == alone["count"]
    assert answer(full) == answer(streamed) and answer(full)[0] != answer(plain)[0]
    stack.wait_idle()


# --- n with a seed -----------------------------------------------------------------------------

FACT = [{"role": "user", "content": "Tell me a fun fact."}]


async def test_n3_seeded_choices_differ_and_reproduce(stack):
    model = stack.model_name

    def body(n: int, stream: bool, **sampling) -> dict:
        return {"model": model, "messages": FACT, "max_tokens": 12, "n": n, "stream": stream, **sampling}

    def texts(result: Result) -> list[str]:
        assert sorted(result.choices) == list(range(len(result.choices)))
        return [result.choices[i].text for i in sorted(result.choices)]

    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
        # Sequential: each request runs with the same batch, so equal seeds give equal draws.
        first = texts(await call(client, body(3, False, temperature=1.0, seed=1234)))
        again = texts(await call(client, body(3, False, temperature=1.0, seed=1234)))
        streamed = texts(await call(client, body(3, True, temperature=1.0, seed=1234)))
        # Choice i of a seeded request is sampled with seed + i.
        single = [texts(await call(client, body(1, False, temperature=1.0, seed=1234 + i)))[0] for i in range(3)]
        greedy = await asyncio.gather(*(call(client, body(n, s, temperature=0)) for n in (3, 1) for s in (False, True)))
    assert len(set(first)) == 3
    assert again == streamed == single == first
    greedy3, greedy3_stream, greedy1, greedy1_stream = map(texts, greedy)
    assert greedy3 == greedy3_stream == greedy1 * 3 == greedy1_stream * 3
    stack.wait_idle()
