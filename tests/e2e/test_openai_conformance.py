"""Conformance: the official ``openai`` package (sync and async, streamed and not)
and raw ``httpx`` against the running stack, over the chat and completions parameters.

Every assertion is exact where the model allows it: greedy (temperature 0) runs are
deterministic, so equivalent requests must give equal text, and token counts follow from
max_tokens / ignore_eos / stop rules. Independent requests run concurrently.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import orjson
import pytest

SAY_HI = [{"role": "user", "content": "Say hi."}]
COUNT = [{"role": "user", "content": "Count from 1 to 30, separated by commas."}]
COUNT_PROMPT = "1, 2, 3, 4, 5,"


@pytest.fixture(scope="module")
def sync_client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def aclient(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _greedy(**kw) -> dict:
    return {"temperature": 0, **kw}


def _usage_ok(usage) -> None:
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


async def _stream_chat(aclient, model, **kw) -> tuple[str, str, list]:
    stream = await aclient.chat.completions.create(model=model, stream=True, **kw)
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1
    return text, finish[0], chunks


def test_sync_chat_and_completions_with_max_tokens(stack, sync_client):
    m = stack.model_name
    chat = sync_client.chat.completions.create(model=m, messages=COUNT, max_tokens=5,
                                               **_greedy(), extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    assert chat.object == "chat.completion" and chat.model == m and chat.system_fingerprint
    _usage_ok(chat.usage)
    mct = sync_client.chat.completions.create(model=m, messages=COUNT, max_completion_tokens=3, **_greedy())
    assert mct.usage.completion_tokens == 3 and mct.choices[0].finish_reason == "length"
    assert chat.choices[0].message.content.startswith(mct.choices[0].message.content)
    cmpl = sync_client.completions.create(model=m, prompt=COUNT_PROMPT, max_tokens=4, **_greedy(),
                                          extra_body={"ignore_eos": True})
    assert cmpl.object == "text_completion" and cmpl.usage.completion_tokens == 4
    assert cmpl.choices[0].finish_reason == "length"
    stream = sync_client.completions.create(model=m, prompt=COUNT_PROMPT, max_tokens=4, stream=True, **_greedy(),
                                            extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == cmpl.choices[0].text
    stack.wait_idle()


async def test_sampling_filters_that_keep_only_the_top_token_equal_greedy(stack, aclient):
    """top_k=1, min_p=1 and a tiny top_p at temperature 1 leave only the argmax token."""
    m = stack.model_name
    base = {"model": m, "messages": COUNT, "max_tokens": 8}
    greedy, *filtered = await asyncio.gather(
        aclient.chat.completions.create(**base, temperature=0),
        aclient.chat.completions.create(**base, temperature=1.0, extra_body={"top_k": 1}),
        aclient.chat.completions.create(**base, temperature=1.0, extra_body={"min_p": 1.0}),
        aclient.chat.completions.create(**base, temperature=1.0, top_p=1e-6),
    )
    for got in filtered:
        assert got.choices[0].message.content == greedy.choices[0].message.content
    stack.wait_idle()


async def test_seed_reproduces_and_n_choices_are_indexed(stack, aclient):
    m = stack.model_name
    base = {"model": m, "messages": COUNT, "max_tokens": 8, "temperature": 1.0}
    a, b, n3, greedy, greedy3 = await asyncio.gather(
        aclient.chat.completions.create(**base, seed=1234),
        aclient.chat.completions.create(**base, seed=1234),
        aclient.chat.completions.create(**base, seed=7, n=3),
        aclient.chat.completions.create(model=m, messages=COUNT, max_tokens=8, temperature=0),
        aclient.chat.completions.create(model=m, messages=COUNT, max_tokens=8, temperature=0, n=3),
    )
    assert a.choices[0].message.content == b.choices[0].message.content
    assert [c.index for c in n3.choices] == [0, 1, 2]
    assert n3.usage.completion_tokens <= 3 * 8 and all(c.finish_reason in ("stop", "length") for c in n3.choices)
    if all(c.finish_reason == "length" for c in n3.choices):
        assert n3.usage.completion_tokens == 3 * 8
    assert [c.message.content for c in greedy3.choices] == [greedy.choices[0].message.content] * 3
    assert greedy3.usage.prompt_tokens == greedy.usage.prompt_tokens
    stack.wait_idle()


async def test_stream_usage_options(stack, aclient):
    m = stack.model_name
    kw = {"messages": COUNT, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    (text, finish, chunks), (_, _, plain_chunks) = await asyncio.gather(
        _stream_chat(aclient, m, stream_options={"include_usage": True}, **kw),
        _stream_chat(aclient, m, **kw),
    )
    assert finish == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    _usage_ok(chunks[-1].usage)
    assert all(c.usage is None for c in chunks[:-1]) and all(c.usage is None for c in plain_chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({(c.id, c.created, c.model) for c in chunks}) == 1
    # continuous_usage_stats (vLLM): every chunk carries the running usage
    body = {"model": m, "messages": COUNT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        r = await client.post("/v1/chat/completions", json=body)
    events = [orjson.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 6 and all(e["usage"] for e in events)
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == text
    stack.wait_idle()


async def test_stop_strings_and_include_stop_str(stack, aclient):
    m = stack.model_name
    base = {"model": m, "prompt": COUNT_PROMPT, "max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    full = (await aclient.completions.create(**base)).choices[0].text
    stop = " 8,"
    assert stop in full, full
    cut = full[: full.index(stop)]
    as_str, as_list, kept, no_trim = await asyncio.gather(
        aclient.completions.create(**base, stop=stop),
        aclient.completions.create(**base, stop=["never-there", stop]),
        aclient.completions.create(**{**base, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}},
                                   stop=stop),
        aclient.completions.create(**{**base, "extra_body": {"ignore_eos": True, "no_stop_trim": True}}, stop=stop),
    )
    for got in (as_str, as_list):
        c = got.choices[0]
        assert c.text == cut and c.finish_reason == "stop"
        assert c.model_extra["matched_stop"] == stop
    for got in (kept, no_trim):
        assert got.choices[0].text == cut + stop and got.choices[0].finish_reason == "stop"
    stack.wait_idle()


async def test_stop_token_ids(stack):
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        native = (await client.post("/generate", json={"text": COUNT_PROMPT, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})).json()
        ids = native["output_ids"]
        target = ids[3]
        first = ids.index(target)
        body = {"model": stack.model_name, "prompt": COUNT_PROMPT, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "stop_token_ids": [target]}
        got = (await client.post("/v1/completions", json=body)).json()
    c = got["choices"][0]
    assert c["finish_reason"] == "stop" and c["matched_stop"] == target
    assert got["usage"]["completion_tokens"] == first + 1
    assert native["text"].startswith(c["text"])
    stack.wait_idle()


async def test_logprobs_and_echo_through_the_sdk(stack, aclient):
    m = stack.model_name
    chat, cmpl = await asyncio.gather(
        aclient.chat.completions.create(model=m, messages=COUNT, max_tokens=6, temperature=0, logprobs=True,
                                        top_logprobs=2),
        aclient.completions.create(model=m, prompt=COUNT_PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=True),
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    c = cmpl.choices[0]
    # echo + logprobs scores the prompt's tokens too: the first has no logprob.
    n_prompt = cmpl.usage.prompt_tokens
    assert c.text.startswith(COUNT_PROMPT) and len(c.logprobs.tokens) == n_prompt + cmpl.usage.completion_tokens
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in c.logprobs.token_logprobs[1:])
    assert c.logprobs.text_offset[0] == 0 and c.logprobs.text_offset[n_prompt] == len(COUNT_PROMPT)
    stack.wait_idle()


async def test_penalties_change_a_repetitive_continuation(stack, aclient):
    m = stack.model_name
    prompt = "a a a a a a a a a a"
    base = {"model": m, "prompt": prompt, "max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain, rep, pres, freq = await asyncio.gather(
        aclient.completions.create(**base),
        aclient.completions.create(**{**base, "extra_body": {"ignore_eos": True, "repetition_penalty": 2.0}}),
        aclient.completions.create(**base, presence_penalty=2.0),
        aclient.completions.create(**base, frequency_penalty=2.0),
    )
    baseline = plain.choices[0].text
    for got in (rep, pres, freq):
        assert got.choices[0].text != baseline
        assert got.usage.completion_tokens == 16
    stack.wait_idle()


async def test_logit_bias_forces_a_token(stack, aclient):
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        tok = (await client.post("/v1/tokenize", json={"prompt": " banana", "add_special_tokens": False})).json()
        (token_id,) = tok["tokens"]
        expected = (await client.post("/v1/detokenize", json={"tokens": [token_id] * 3})).json()["prompt"]
    m = stack.model_name
    chat, cmpl = await asyncio.gather(
        aclient.chat.completions.create(model=m, messages=COUNT, max_tokens=3, temperature=0,
                                        logit_bias={str(token_id): 100}),
        aclient.completions.create(model=m, prompt=COUNT_PROMPT, max_tokens=3, temperature=0,
                                   logit_bias={str(token_id): 100}),
    )
    assert chat.choices[0].message.content == expected.lstrip() or chat.choices[0].message.content == expected
    assert cmpl.choices[0].text == expected
    stack.wait_idle()


async def test_min_tokens_ignore_eos_and_skip_special_tokens(stack, aclient):
    m = stack.model_name
    short = await aclient.chat.completions.create(model=m, messages=SAY_HI, max_tokens=40, temperature=0)
    n = short.usage.completion_tokens
    assert short.choices[0].finish_reason == "stop" and n < 40
    longer, ignored, kept, skipped = await asyncio.gather(
        aclient.chat.completions.create(model=m, messages=SAY_HI, max_tokens=40, temperature=0,
                                        extra_body={"min_tokens": n + 3}),
        aclient.chat.completions.create(model=m, messages=SAY_HI, max_tokens=n + 4, temperature=0,
                                        extra_body={"ignore_eos": True}),
        aclient.chat.completions.create(model=m, messages=SAY_HI, max_tokens=n + 2, temperature=0,
                                        extra_body={"ignore_eos": True, "skip_special_tokens": False}),
        aclient.chat.completions.create(model=m, messages=SAY_HI, max_tokens=n + 2, temperature=0,
                                        extra_body={"ignore_eos": True, "skip_special_tokens": True}),
    )
    assert longer.usage.completion_tokens >= n + 3
    assert ignored.usage.completion_tokens == n + 4 and ignored.choices[0].finish_reason == "length"
    assert ignored.choices[0].message.content.startswith(short.choices[0].message.content)
    assert "<|im_end|>" in kept.choices[0].message.content
    assert "<|im_end|>" not in skipped.choices[0].message.content
    stack.wait_idle()


async def test_template_flags_tools_user_and_rid(stack, aclient):
    m = stack.model_name
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        with_gen = (await client.post("/v1/tokenize", json={"messages": SAY_HI})).json()
        without = (await client.post("/v1/tokenize", json={"messages": SAY_HI, "add_generation_prompt": False})).json()
    assert with_gen["prompt"] == without["prompt"] + "<|im_start|>assistant\n"
    assert with_gen["count"] > without["count"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    cont_msgs = [*SAY_HI, {"role": "assistant", "content": "Hello"}]
    plain, no_gen, cont, none_tools, kwargs, rid = await asyncio.gather(
        aclient.chat.completions.create(model=m, messages=SAY_HI, max_tokens=3, temperature=0),
        aclient.chat.completions.create(model=m, messages=SAY_HI, max_tokens=3, temperature=0,
                                        extra_body={"add_generation_prompt": False}),
        aclient.chat.completions.create(model=m, messages=cont_msgs, max_tokens=3, temperature=0,
                                        extra_body={"add_generation_prompt": False, "continue_final_message": True}),
        aclient.chat.completions.create(model=m, messages=SAY_HI, max_tokens=3, temperature=0, tools=tools,
                                        tool_choice="none"),
        aclient.chat.completions.create(model=m, messages=SAY_HI, max_tokens=3, temperature=0,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}}),
        aclient.chat.completions.create(model=m, messages=SAY_HI, max_tokens=3, temperature=0, user="alice",
                                        extra_body={"rid": "conformance-rid-1"}),
    )
    assert plain.usage.prompt_tokens == with_gen["count"]
    assert no_gen.usage.prompt_tokens == without["count"]
    assert not cont.choices[0].message.content.startswith("Hello")
    # The ring renders with the shipped ChatML tools template (SmolLM2's own has no tools slot):
    # under tool_choice "auto" the tools are in the prompt; under "none" they never reach it.
    offered = await aclient.chat.completions.create(model=m, messages=SAY_HI, max_tokens=3, temperature=0,
                                                    tools=tools, tool_choice="auto")
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens
    for got in (none_tools, kwargs, rid):
        assert got.choices[0].message.content == plain.choices[0].message.content
        assert got.usage.prompt_tokens == plain.usage.prompt_tokens
    assert rid.id == "chatcmpl-conformance-rid-1"
    stack.wait_idle()


async def test_raw_http_framing_and_status_codes(stack):
    m = stack.model_name
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        body = {"model": m, "messages": COUNT, "max_tokens": 3, "temperature": 0, "stream": True, "n": 2}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.text.endswith("data: [DONE]\n\n") and r.text.count("data: [DONE]") == 1
        events = r.text.split("\n\n")[:-1]
        assert all(e.startswith("data: ") and "\n" not in e for e in events)
        chunks = [orjson.loads(e[6:]) for e in events[:-1]]
        finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                    if c["choices"][0]["finish_reason"]}
        assert finishes == {0: "length", 1: "length"}
        cases = [
            ({"model": m, "messages": COUNT, "bogus": 1}, 400, "bogus"),
            ({"model": "no-such-model", "messages": COUNT}, 404, "model"),
            ({"model": m, "messages": COUNT, "temperature": "hot"}, 400, "temperature"),
            ({"model": m, "messages": COUNT, "max_tokens": True}, 400, "max_tokens"),
        ]
        for payload, status, param in cases:
            for stream in (False, True):
                got = await client.post("/v1/chat/completions", json={**payload, "stream": stream})
                assert got.status_code == status and got.headers["content-type"] == "application/json"
                assert got.json()["error"]["param"] == param
        bad = await client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == m
        assert (await client.get(f"/v1/models/{m}")).json()["id"] == m
    stack.wait_idle()
