"""Every sampling parameter of the table (``ringserve.sampling_params``) through the running ring.

A value inside its range is served on chat, completions, /generate and the tokenizer's gRPC
Generate (the scheduler samples with it and the request ends normally); a value outside is
refused on each entry point with the same message (``violation``): a 400 naming the field
over HTTP, INVALID_ARGUMENT over gRPC. A parameter added to the table is covered here with no
test written for it.
"""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from ringserve import sampling_params as table
from ringserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tests.helpers.sampling_cases import NUMERIC, inside, outside

USER = [{"role": "user", "content": "Count to five."}]
FINISHED = {"stop", "length"}


def _http(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.base_url}{path}", timeout=120, content=json.dumps(body),
                      headers={"content-type": "application/json"})


def _grpc(stack, sampling: dict) -> list[tokenizer_pb2.GenerateOutput]:
    req = tokenizer_pb2.GenerateReqInput(text="Count to five.", sampling_params=common_pb2.SamplingParams(**sampling))
    with grpc.insecure_channel(stack.tokenizer) as ch:
        return list(tokenizer_pb2_grpc.TokenizerStub(ch).Generate(req, timeout=120, metadata=stack.grpc_metadata))


@pytest.mark.parametrize("p", table.TABLE, ids=lambda p: p.name)
def test_every_parameter_is_served(stack, p):
    value = inside(p)
    choices = value if p.name == "n" else 1
    http = {"max_tokens": 3, p.http_name: value}
    native = {"max_new_tokens": 3, p.name: value}
    chat = _http(stack, "/v1/chat/completions", {"model": stack.model_name, "messages": USER, **http})
    assert chat.status_code == 200, chat.text
    assert [c["finish_reason"] in FINISHED for c in chat.json()["choices"]] == [True] * choices
    completion = _http(stack, "/v1/completions", {"model": stack.model_name, "prompt": "Count to five.", **http})
    assert completion.status_code == 200, completion.text
    assert [c["finish_reason"] in FINISHED for c in completion.json()["choices"]] == [True] * choices
    generate = _http(stack, "/generate", {"text": "Count to five.", "sampling_params": native})
    assert generate.status_code == 200, generate.text
    outs = _grpc(stack, native)
    finished = [o for o in outs if o.finish_reason.type != common_pb2.FINISH_NONE]
    assert sorted(o.index for o in finished) == list(range(choices))
    assert all(o.finish_reason.type in (common_pb2.FINISH_STOP, common_pb2.FINISH_LENGTH) for o in finished)
    assert all(0 < o.completion_tokens <= 3 for o in finished)


@pytest.mark.parametrize("p", NUMERIC, ids=lambda p: p.name)
def test_out_of_range_is_refused_alike_everywhere(stack, p):
    for value in outside(p, proto=True):
        with pytest.raises(grpc.RpcError) as info:
            _grpc(stack, {p.name: value})
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == table.violation(p, value), value
    for value in outside(p):
        chat = _http(stack, "/v1/chat/completions", {"model": stack.model_name, "messages": USER, p.http_name: value})
        assert (chat.status_code, chat.json()["error"]["message"]) == (400, table.violation(p, value, p.http_name))
        generate = _http(stack, "/generate", {"text": "hi", "sampling_params": {p.name: value}})
        message = table.violation(p, value, f"sampling_params.{p.name}")
        assert (generate.status_code, generate.json()["error"]["message"]) == (400, message)
    assert stack.tokenizer_load().req_states == 0
