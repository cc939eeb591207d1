"""Case C05 of docs/cases.md: invalid requests are rejected before any SSE byte.

Every variant of the case, on chat and on completions where it applies, with ``stream``
true and false: one JSON OpenAI error object with the exact status, type and param, and
for a context overflow the code ``context_length_exceeded`` and a message that states the
context length and the prompt's token count.
"""

from __future__ import annotations

import asyncio
import re

import httpx

USER = [{"role": "user", "content": "Say hi."}]


def check_error(resp: httpx.Response, status: int, param: str | None, code: str | None = None) -> str:
    """Assert one OpenAI error object; return its message."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["type"] == "invalid_request_error", err
    assert err["param"] == param, err
    assert isinstance(err["code"], str) and err["code"], err
    if code is not None:
        assert err["code"] == code, err
    # No negative number is ever echoed (a client cannot tell a given -5 from a computed one).
    assert not re.search(r"(?<![\w-])-\d", err["message"]), err
    return err["message"]


async def token_count(client: httpx.AsyncClient, model: str, body: dict) -> int:
    """Prompt tokens of a request body, through /v1/tokenize (messages rendered with the template)."""
    key = {"messages": body["messages"]} if "messages" in body else {"prompt": body["prompt"]}
    resp = await client.post("/v1/tokenize", json={"model": model, **key})
    assert resp.status_code == 200, resp.text
    return resp.json()["count"]


async def test_c05_invalid_requests_rejected_before_streaming(stack):
    model = stack.model_name
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
        context = (await client.get("/v1/models")).json()["data"][0]["max_model_len"]
        too_long = "hello " * (context * 6 // 5)  # one token per word: ~1.2x the window
        fits = "hello " * (context - 200)

        def with_prompt(key: str, text: str, **extra) -> dict:
            prompt = [{"role": "user", "content": text}] if key == "messages" else text
            return {"model": model, key: prompt, **extra}

        overflow = []  # (body, param): the context-length variants
        for key in ("messages", "prompt"):
            overflow += [(with_prompt(key, too_long), key), (with_prompt(key, too_long, max_tokens=16), key)]
            room = context - await token_count(client, model, with_prompt(key, fits))
            assert 0 < room < 300
            overflow.append((with_prompt(key, fits, max_tokens=room + 1), "max_tokens"))  # one token over
        # Token-id prompts, and a batch whose second prompt is too long (nothing may start).
        long_ids = [5] * (context * 6 // 5)
        ids_prompts = [({"model": model, "prompt": long_ids}, len(long_ids)),
                       ({"model": model, "prompt": ["Hi", too_long], "max_tokens": 4},
                        await token_count(client, model, {"prompt": too_long})),
                       ({"model": model, "prompt": [[5, 6], long_ids], "max_tokens": 4}, len(long_ids))]

        invalid = [  # (extra fields of a chat body, status, param, code)
            ({"max_tokens": 0}, 400, "max_tokens", None),
            ({"max_tokens": -5}, 400, "max_tokens", None),
            ({"max_completion_tokens": -5}, 400, "max_completion_tokens", None),
            ({"temperature": -1}, 400, "temperature", None),
            ({"temperature": 3}, 400, "temperature", None),
            ({"top_p": 1.5}, 400, "top_p", None),
            ({"n": 0}, 400, "n", None),
            ({"min_tokens": 8, "max_tokens": 4}, 400, "min_tokens", None),
            ({"min_tokens": 8, "max_completion_tokens": 4}, 400, "min_tokens", None),
            ({"max_tokens": 2**40}, 400, "max_tokens", None),  # beyond what the wire can carry
            ({"model": "no-such-model"}, 404, "model", "model_not_found"),
        ]

        async def send(body: dict, stream: bool) -> httpx.Response:
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            return await client.post(path, json={**body, "stream": stream})

        streams = (False, True)
        overflow_resps = await asyncio.gather(*(send(b, s) for b, _ in overflow for s in streams))
        invalid_resps = await asyncio.gather(
            *(send({"model": model, "messages": USER, **extra}, s) for extra, *_ in invalid for s in streams)
        )
        completion_resps = await asyncio.gather(  # the sampling checks are the same on completions
            *(send({"model": model, "prompt": "Hi", **extra}, s) for extra, *_ in invalid for s in streams
              if "max_completion_tokens" not in extra)
        )
        counts = await asyncio.gather(*(token_count(client, model, b) for b, _ in overflow))
        ids_resps = await asyncio.gather(*(send(b, s) for b, _ in ids_prompts for s in streams))
        malformed = [
            await client.post(path, content=raw, headers={"Content-Type": "application/json"})
            for path in ("/v1/chat/completions", "/v1/completions")
            for raw in (b'{"model": "m", "stream": true, "messages": [',
                        b'{"model": "m", "stream": false, "prompt": "x",}')
        ]

    for i, ((_body, param), n_prompt) in enumerate(zip(overflow, counts, strict=True)):
        for resp in overflow_resps[2 * i : 2 * i + 2]:
            message = check_error(resp, 400, param, "context_length_exceeded")
            assert f"maximum context length is {context} tokens" in message, message
            assert f"{n_prompt} tokens" in message or f"({n_prompt} in the" in message, message
    assert [c > context for c in counts] == [True, True, False] * 2  # the variants are what they claim
    for i, (_, n_prompt) in enumerate(ids_prompts):
        for resp in ids_resps[2 * i : 2 * i + 2]:
            message = check_error(resp, 400, "prompt", "context_length_exceeded")
            assert f"maximum context length is {context} tokens" in message, message
            assert f"{n_prompt} tokens" in message or f"({n_prompt} in the" in message, message
    for i, (_extra, status, param, code) in enumerate(invalid):
        for resp in invalid_resps[2 * i : 2 * i + 2]:
            check_error(resp, status, param, code)
    plain = [row for row in invalid if "max_completion_tokens" not in row[0]]
    for i, (_extra, status, param, code) in enumerate(plain):
        for resp in completion_resps[2 * i : 2 * i + 2]:
            check_error(resp, status, param, code)
    for resp in malformed:
        check_error(resp, 400, None, "invalid_json")
    stack.wait_idle()
