"""``POST /v1/embeddings`` against the fake tokenizer: every input shape, both encodings, the
response and usage exactly, and every bad input refused with a 400 naming its field."""

from __future__ import annotations

import base64
import struct

import grpc
import pytest

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def post(stack, **body):
    stack.fake.reset()
    stack.fake.embed_requests.clear()
    return await stack.client.post("/v1/embeddings", json={"model": stack.model, **body})


def inputs(stack) -> list:
    (req,) = stack.fake.embed_requests
    return [item.text if item.WhichOneof("input") == "text" else list(item.input_ids.ids) for item in req.inputs]


@pytest.mark.parametrize("given,sent", [
    ("hello", ["hello"]),
    (["a", "bcd"], ["a", "bcd"]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5], [6, 7]], [[5], [6, 7]]),
])
async def test_every_input_shape(stack, given, sent):
    r = await post(stack, input=given)
    assert r.status_code == 200, r.text
    assert inputs(stack) == sent
    lens = [len(s) for s in sent]
    assert r.json() == {
        "object": "list", "model": stack.model,
        "data": [{"object": "embedding", "index": i, "embedding": [float(i), 0.5, -float(n)]}
                 for i, n in enumerate(lens)],
        "usage": {"prompt_tokens": sum(lens), "total_tokens": sum(lens)},
    }


async def test_base64_is_little_endian_float32(stack):
    r = await post(stack, input=["ab", "c"], encoding_format="base64", user="u-1")
    assert r.status_code == 200, r.text
    got = [struct.unpack("<3f", base64.b64decode(d["embedding"])) for d in r.json()["data"]]
    assert got == [(0.0, 0.5, -2.0), (1.0, 0.5, -1.0)]


async def test_dimensions_travel_to_the_tokenizer_which_names_them(stack):
    r = await post(stack, input="a", dimensions=64)
    assert r.status_code == 200 and stack.fake.embed_requests[0].dimensions == 64
    stack.fake.reset(stack.Fail(grpc.StatusCode.INVALID_ARGUMENT, "dimensions is not supported by this model",
                                (("code", "invalid_value"), ("param", "dimensions"))))
    r = await stack.client.post("/v1/embeddings", json={"input": "a", "dimensions": 64})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "dimensions is not supported by this model",
                                 "type": "invalid_request_error", "param": "dimensions", "code": "invalid_value"}


@pytest.mark.parametrize("body,param,message", [
    ({"input": []}, "input", "input must not be empty"),
    ({"input": ""}, "input", "input is empty"),
    ({"input": ["a", ""]}, "input", "input[1] is empty"),
    ({"input": [[1], []]}, "input", "input[1] is empty"),
    ({"input": ["a"] * 2049}, "input", "input holds 2049 inputs; at most 2048 are allowed"),
    ({"input": [-1]}, "input", None),
    ({"input": "a", "dimensions": 0}, "dimensions", None),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", None),
    ({"input": "a", "pooling": "mean"}, "pooling", None),
    ({}, "input", None),
])
async def test_bad_input_is_a_400_naming_the_field(stack, body, param, message):
    r = await post(stack, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    if message is not None:
        assert error["message"] == message
    assert stack.fake.embed_requests == []


async def test_another_model_is_404(stack):
    r = await stack.client.post("/v1/embeddings", json={"model": "other", "input": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
