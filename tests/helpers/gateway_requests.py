"""Request bodies for the gateway's endpoints, and the check of an OpenAI error answer."""

from __future__ import annotations

MSG = [{"role": "user", "content": "hi"}]


def assert_error(r, status: int, param=None, code=None, type_: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_ and isinstance(err["message"], str) and err["message"]
    assert err["param"] == param, err
    assert err["code"] == code, err
    assert "Traceback" not in r.text
    return err


def body_for(path: str, override: dict) -> dict:
    if path == "/generate":
        return {"text": "hi", "sampling_params": {"max_new_tokens": 2}, **override}
    base = {"model": "smol", "max_tokens": 2}
    base.update({"messages": MSG} if path == "/v1/chat/completions" else {"prompt": "hi"})
    return {**base, **override}


def call(arguments: str) -> dict:
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}
