"""Against the real ring: no string in any field of any endpoint gives a
5xx (lone surrogates are a 400 naming the field; NULs are served or refused with a 4xx), and
the ring still serves afterwards. Over gRPC, a request whose string field is not UTF-8 is
INVALID_ARGUMENT from every unary method of the tokenizer, and JSON fields holding escaped
surrogates are refused the same way."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringserve.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from tests.helpers.ringstack import still_serves
from tests.helpers.string_slots import body_with, endpoint_slots

SLOTS = endpoint_slots()
ALL = [(route, slot) for route, slots in SLOTS.items() for slot in slots]
plain = st.characters(blacklist_categories=("Cs",), max_codepoint=0x2FFF)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_no_string_gives_5xx(stack, data):
    route, slot = data.draw(st.sampled_from(ALL))
    surrogate = data.draw(st.booleans())
    middle = data.draw(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)) if surrogate else "\x00"
    value = data.draw(st.text(plain, max_size=3)) + middle + data.draw(st.text(plain, max_size=3))
    body = body_with(route, slot, value)
    if route != "/abort_request":
        body["model"] = body.get("model", stack.model_name) if slot != ("model",) else value
    with httpx.Client(base_url=stack.base_url, timeout=60) as client:
        r = client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code < 500, (route, slot, r.status_code, r.text)
        if surrogate:
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_encoding", r.text
        ok = client.post("/v1/completions", json={"model": stack.model_name, "prompt": "1 2 3", "max_tokens": 1})
        assert ok.status_code == 200, ok.text


def _raw(stack, method: str, payload: bytes, response) -> grpc.RpcError:
    with grpc.insecure_channel(stack.tokenizer) as ch:
        stub = ch.unary_stream if method == "Generate" else ch.unary_unary
        call = stub(f"/ringserve.v1.Tokenizer/{method}", request_serializer=lambda b: b,
                    response_deserializer=response.FromString)
        with pytest.raises(grpc.RpcError) as info:
            result = call(payload, timeout=10)
            list(result) if method == "Generate" else None
    return info.value


@pytest.mark.parametrize("method,msg,response", [
    ("Generate", tokenizer_pb2.GenerateReqInput(rid="bad-utf8", text="ab"), tokenizer_pb2.GenerateOutput),
    ("Tokenize", tokenizer_pb2.TokenizeRequest(text="ab"), tokenizer_pb2.TokenizeResponse),
    ("Abort", tokenizer_pb2.AbortRequest(rid="ab"), tokenizer_pb2.AbortResponse),
    ("Embed", tokenizer_pb2.EmbedRequest(inputs=[tokenizer_pb2.EmbedInput(text="ab")]), tokenizer_pb2.EmbedResponse),
])
def test_grpc_string_not_utf8_is_invalid_argument(stack, method, msg, response):
    payload = msg.SerializeToString().replace(b"ab", b"\xed\xbf")  # a surrogate's bytes: not UTF-8
    err = _raw(stack, method, payload, response)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details() == ("the request could not be parsed: Error parsing message with type "
                             f"'ringserve.v1.{type(msg).__name__}': String field had bad UTF-8"), err.details()


@pytest.mark.parametrize("field", ["tools_json", "chat_template_kwargs_json"])
def test_grpc_json_field_with_escaped_surrogate(stack, field):
    value = '[{"type": "function", "function": {"name": "\\udfff"}}]' if field == "tools_json" else '{"x": "\\udfff"}'
    chat = tokenizer_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="user", content="hi")], **{field: value})
    with grpc.insecure_channel(stack.tokenizer) as ch:
        stub = tokenizer_pb2_grpc.TokenizerStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(tokenizer_pb2.GenerateReqInput(rid=f"bad-json-{field}", chat=chat), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    assert field.removesuffix("_json") in info.value.details() or field in info.value.details()
    still_serves(stack)
