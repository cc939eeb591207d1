"""Error objects and statuses: the gateway's own validation (C05), the mapping of the
tokenizer's gRPC statuses, API keys, and a dead tokenizer."""

from __future__ import annotations

import grpc
import orjson
import pytest

from ringserve.v1 import tokenizer_pb2
from tests.helpers.gateway_requests import MSG, assert_error

pytestmark = pytest.mark.asyncio(loop_scope="session")


# (body overrides, param, code) for chat; each is checked with stream true and false.
CHAT_INVALID = [
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": -5}, "max_tokens", "invalid_value"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ({"temperature": -1}, "temperature", "invalid_value"),
    ({"temperature": 3}, "temperature", "invalid_value"),
    ({"top_p": 1.5}, "top_p", "invalid_value"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"n": 0}, "n", "invalid_value"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens", "invalid_value"),
    ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "unsupported_content_type"),
    ({"continue_final_message": True, "add_generation_prompt": True,
      "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "continue_final_message", "invalid_value"),
    ({"continue_final_message": True}, "continue_final_message", "invalid_value"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
    ({"stop": ["", "x"]}, "stop", "invalid_value"),
    ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "invalid_value"),
    # Output constraints and tools.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "invalid_value"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "invalid_value"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex", "invalid_value"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "invalid_value"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", "unknown_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]},
     "tools", "invalid_value"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tool_choice": "auto"}, "tool_choice", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "invalid_value"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("override,param,code", CHAT_INVALID)
async def test_chat_validation(stack, stream, override, param, code):
    stack.fake.reset(stack.out("never", finish="stop"))
    body = {"model": stack.model, "messages": MSG, "stream": stream, **override}
    r = await stack.client.post("/v1/chat/completions", json=body)
    err = assert_error(r, 400, param, code)
    assert "-5" not in err["message"]
    assert stack.fake.requests == [], "nothing may be sent to the tokenizer"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "override,param",
    [({"max_tokens": 0}, "max_tokens"), ({"temperature": 3}, "temperature"), ({"n": 0}, "n"),
     ({"prompt": []}, "prompt"), ({"suffix": "x"}, "suffix"), ({"logprobs": 50}, "logprobs")],
)
async def test_completions_validation(stack, stream, override, param):
    stack.fake.reset(stack.out("never", finish="stop"))
    body = {"model": stack.model, "prompt": "hi", "stream": stream, **override}
    assert_error(await stack.client.post("/v1/completions", json=body), 400, param, r_code(override))
    assert stack.fake.requests == []


def r_code(override: dict) -> str:
    return "unknown_parameter" if "suffix" in override else "invalid_value"


async def test_unknown_fields_are_all_named():
    from services.gateway.errors import from_validation_errors

    err = from_validation_errors([
        {"type": "extra_forbidden", "loc": ("body", "foo")}, {"type": "extra_forbidden", "loc": ("body", "bar")}])
    assert err.message == "Unrecognized request arguments supplied: foo, bar"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/generate"])
@pytest.mark.parametrize("raw", [b'{"model": "smol", "messages": [', b"", b"[1, 2]", b"null"])
async def test_malformed_json(stack, path, raw):
    r = await stack.client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("body", [{}, {"text": "hi", "input_ids": [1]}, {"text": None}])
async def test_generate_takes_exactly_one_of_text_and_input_ids(stack, body):
    r = await stack.client.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 1}})
    err = assert_error(r, 400, "text", "invalid_value", "invalid_request_error")
    assert err["message"] == "give exactly one of text and input_ids"


async def test_generate_takes_at_most_one_output_constraint(stack):
    params = {"max_new_tokens": 1, "regex": "a", "ebnf": 'root ::= "a"'}
    r = await stack.client.post("/generate", json={"text": "hi", "sampling_params": params})
    err = assert_error(r, 400, "sampling_params.ebnf", "invalid_value", "invalid_request_error")
    assert err["message"] == "give at most one output constraint, got sampling_params.regex and sampling_params.ebnf"


@pytest.mark.parametrize("stream", [False, True])
async def test_unknown_model_is_404(stack, stream):
    body = {"model": "gpt-9", "messages": MSG, "stream": stream}
    err = assert_error(await stack.client.post("/v1/chat/completions", json=body), 404, "model", "model_not_found",
                       "invalid_request_error")
    assert "gpt-9" in err["message"]
    r = await stack.client.post("/v1/completions", json={"model": "gpt-9", "prompt": "x", "stream": stream})
    assert_error(r, 404, "model", "model_not_found", "invalid_request_error")


GRPC_CASES = [
    (grpc.StatusCode.INVALID_ARGUMENT, (("code", "context_length_exceeded"), ("param", "messages")),
     400, "invalid_request_error", "messages", "context_length_exceeded", False),
    (grpc.StatusCode.INVALID_ARGUMENT, (), 400, "invalid_request_error", None, None, False),
    (grpc.StatusCode.ALREADY_EXISTS, (), 400, "invalid_request_error", "rid", "duplicate_request_id", False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, (), 429, "rate_limit_error", None, "server_overloaded", True),
    (grpc.StatusCode.UNAVAILABLE, (), 503, "service_unavailable_error", None, "service_unavailable", True),
    (grpc.StatusCode.INTERNAL, (), 500, "server_error", None, "internal_error", False),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("code,metadata,status,type_,param,err_code,retry", GRPC_CASES)
async def test_grpc_status_mapping(stack, stream, code, metadata, status, type_, param, err_code, retry):
    details = "This model's maximum context length is 2048 tokens; the prompt has 2458 tokens"
    stack.fake.reset(stack.Fail(code, details, metadata))
    body = {"model": stack.model, "messages": MSG, "stream": stream}
    r = await stack.client.post("/v1/chat/completions", json=body)
    err = assert_error(r, status, param, err_code, type_)
    assert err["message"] == details
    assert (r.headers.get("retry-after") == "1") is retry


async def test_api_key(keyed, stack):
    body = {"model": "smol", "messages": MSG}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"},
                    {"Authorization": "Bearer sekri"}, {"Authorization": "Bearer sekrit,rotated"}):
        r = await keyed.post("/v1/chat/completions", json=body, headers=headers)
        assert_error(r, 401, None, "invalid_api_key", "authentication_error")
    # malformed JSON without a key is still a 401: the key is checked first
    r = await keyed.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 401
    r = await keyed.get("/v1/models", headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "smol"
    assert (await keyed.get("/health")).status_code == 200
    # Either of two keys (rotation); the gateway presents its first key to the tokenizer.
    for key in ("sekrit", "rotated"):
        stack.fake.reset(stack.out("Paris", finish="stop"))
        stack.fake.authorizations.clear()
        r = await keyed.post("/v1/chat/completions", json=body, headers={"Authorization": f"bearer {key}"})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Paris"
        assert stack.fake.authorizations == ["Bearer sekrit"]


async def test_tokenizer_refusing_the_gateways_key_is_a_server_error(stack, caplog):
    """The client's key passed the gateway; a key mismatch between gateway and tokenizer is
    the server's fault: 500, and a log line that says what to fix."""
    stack.fake.reset(stack.Fail(grpc.StatusCode.UNAUTHENTICATED, "invalid API key"))
    r = await stack.client.post("/v1/chat/completions", json={"model": "smol", "messages": MSG})
    err = assert_error(r, 500, None, "internal_error", "server_error")
    assert err["message"] == "the server's tokenizer refused the gateway's API key (a server configuration error)"
    assert "the tokenizer refused the gateway's API key (invalid API key)" in caplog.text


async def test_tokenizer_down(orphan):
    r = await orphan.get("/health")
    assert_error(r, 503, None, "service_unavailable", "service_unavailable_error")
    for stream in (False, True):
        r = await orphan.post("/v1/chat/completions", json={"model": "smol", "messages": MSG, "stream": stream})
        assert_error(r, 503, None, "service_unavailable", "service_unavailable_error")
        assert r.headers["retry-after"] == "1"


async def test_unknown_route_is_an_openai_error(stack):
    r = await stack.client.get("/v1/nothing")
    assert_error(r, 404, None, "not_found", "not_found_error")
    r = await stack.client.get("/v1/chat/completions")
    assert_error(r, 405, None, "method_not_allowed")


async def test_health_follows_tokenizer_readiness(stack):
    """/health is the tokenizer's GetReadiness: 200 with the replicas that cannot move a token
    while one can, 503 with an OpenAI error and every reason while none can."""
    assert orjson.loads((await stack.client.get("/health")).content) == {"status": "ok", "replicas": 1,
                                                                        "not_ready": []}
    stalled = tokenizer_pb2.NotReady(replica="10.0.0.1:30020", reason="detokenizer_health_check",
                                     message="the detokenizer at 10.0.0.2:30030 did not answer its health check "
                                             "within 2 s")
    down = tokenizer_pb2.NotReady(replica="10.0.0.3:30020", reason="scheduler_link_down",
                                  message="the scheduler at 10.0.0.3:30020 is not connected")
    reasons = [{"replica": r.replica, "reason": r.reason, "message": r.message} for r in (stalled, down)]
    try:
        stack.fake.readiness = tokenizer_pb2.Readiness(ready=True, replicas=3, not_ready=[stalled, down])
        r = await stack.client.get("/health")
        assert r.status_code == 200 and r.json() == {"status": "ok", "replicas": 3, "not_ready": reasons}
        stack.fake.readiness = tokenizer_pb2.Readiness(ready=False, replicas=2, not_ready=[stalled, down])
        r = await stack.client.get("/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json() == {
            "error": {"message": "the ring cannot move a token: " + "; ".join(x["message"] for x in reasons),
                      "type": "service_unavailable_error", "param": None, "code": "service_unavailable"},
            "status": "not_ready", "replicas": 2, "not_ready": reasons}
    finally:
        stack.fake.readiness = tokenizer_pb2.Readiness(ready=True, replicas=1)
    assert (await stack.client.get("/health")).status_code == 200


async def test_form_content_type_is_read_as_json(stack):
    """``curl -d`` sends JSON as application/x-www-form-urlencoded."""
    stack.fake.reset(stack.out("ok", finish="stop"))
    raw = orjson.dumps({"model": "smol", "messages": MSG})
    r = await stack.client.post("/v1/chat/completions", content=raw,
                                headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
