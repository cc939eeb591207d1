"""The ``priority`` field at the gateway: chat, completions (every prompt of a batch) and
/generate pass it to the tokenizer as ``GenerateReqInput.priority`` (0 when absent), and refuse
a value outside int32 before anything is sent, with the bound message every entry point gives."""

from __future__ import annotations

import pytest

from ringserve.priority import PRIORITY
from ringserve.sampling_params import violation

pytestmark = pytest.mark.asyncio(loop_scope="session")

MSG = [{"role": "user", "content": "hi"}]


def bodies(stack, **extra) -> list[tuple[str, dict]]:
    return [
        ("/v1/chat/completions", {"model": stack.model, "messages": MSG, **extra}),
        ("/v1/completions", {"model": stack.model, "prompt": ["hi", "there"], **extra}),
        ("/generate", {"text": "hi", **extra}),
    ]


@pytest.mark.parametrize("given, sent", [({"priority": -7}, -7), ({"priority": 2**31 - 1}, 2**31 - 1), ({}, 0)])
async def test_the_priority_reaches_the_tokenizer(stack, given, sent):
    for path, body in bodies(stack, **given):
        calls = 2 if path == "/v1/completions" else 1
        stack.fake.reset(*[stack.out("x", finish="stop") for _ in range(calls)])
        r = await stack.client.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
        assert [req.priority for req in stack.fake.requests] == [sent] * calls, path


@pytest.mark.parametrize("value", [2**31, -(2**31) - 1, 1.5, "1"])
async def test_a_priority_outside_int32_is_refused(stack, value):
    for path, body in bodies(stack, priority=value):
        stack.fake.reset(stack.out("never", finish="stop"))
        r = await stack.client.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == "priority", path
        if isinstance(value, int):
            assert (err["message"], err["code"]) == (violation(PRIORITY, value), "invalid_value")
        assert stack.fake.requests == []
