"""Every sampling parameter of the table (``ringserve.sampling_params``) at the gateway: chat,
completions and /generate pass an in-range value to the tokenizer under the proto's name, and
refuse each out-of-range value before anything is sent, with the message the tokenizer and the
scheduler give (``violation``), under the field's path."""

from __future__ import annotations

import json

import pytest

from ringserve import sampling_params as table
from tests.helpers.sampling_cases import NUMERIC, inside, outside

pytestmark = pytest.mark.asyncio(loop_scope="session")

MSG = [{"role": "user", "content": "hi"}]


def bodies(stack, p: table.Param, value) -> list[tuple[str, dict]]:
    return [
        ("/v1/chat/completions", {"model": stack.model, "messages": MSG, p.http_name: value}),
        ("/v1/completions", {"model": stack.model, "prompt": "hi", p.http_name: value}),
        ("/generate", {"text": "hi", "sampling_params": {p.name: value}}),
    ]


@pytest.mark.parametrize("p", table.TABLE, ids=lambda p: p.name)
async def test_every_parameter_reaches_the_tokenizer(stack, p):
    value = inside(p)
    for path, body in bodies(stack, p, value):
        choices = value if p.name == "n" else 1
        stack.fake.reset(*[stack.out("x", index=i, finish="stop") for i in range(choices)])
        r = await stack.client.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
        sp = stack.fake.requests[0].sampling_params
        assert sp.HasField(p.name) and getattr(sp, p.name) == value, path
        assert [f.name for f, _ in sp.ListFields()] == [p.name], path  # nothing else is set


@pytest.mark.parametrize("p", NUMERIC, ids=lambda p: p.name)
async def test_out_of_range_is_refused_with_the_table_message(stack, p):
    for value in outside(p):
        for path, body in bodies(stack, p, value):
            if path == "/v1/completions" and p.name == "max_new_tokens" and value == 0:
                continue  # completions take max_tokens 0 to score the prompt
            stack.fake.reset(stack.out("never", finish="stop"))
            # JSON's NaN is not standard, but Python's json (and the gateway's parser) take it.
            r = await stack.client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, value, r.text)
            err = r.json()["error"]
            where = f"sampling_params.{p.name}" if path == "/generate" else p.http_name
            assert err["message"] == table.violation(p, value, where), (path, value)
            assert (err["param"], err["code"]) == (where.split(".")[0], "invalid_value")
            assert stack.fake.requests == []


async def test_generate_temperature_is_bounded(stack):
    """/generate used to take any temperature >= 0 and leave the refusal to the tokenizer."""
    r = await stack.client.post("/generate", json={"text": "hi", "sampling_params": {"temperature": 3}})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "sampling_params.temperature must be at most 2, got 3"
    assert stack.fake.requests == []


async def test_chat_messages(stack):
    """The words of a few refusals, spelled out."""
    cases = [({"temperature": 2.5}, "temperature must be at most 2, got 2.5"),
             ({"temperature": -1}, "temperature must be at least 0, got a negative value"),
             ({"top_k": 0}, "top_k must be -1 (disabled) or at least 1, got 0"),
             ({"top_k": -3}, "top_k must be -1 (disabled) or at least 1, got a negative value"),
             ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
             ({"logit_bias": {"7": 101}}, "logit_bias[7] must be at most 100, got 101"),
             ({"top_logprobs": 21, "logprobs": True}, "top_logprobs must be at most 20, got 21")]
    for override, message in cases:
        r = await stack.client.post("/v1/chat/completions", json={"model": stack.model, "messages": MSG, **override})
        assert (r.status_code, r.json()["error"]["message"]) == (400, message)
