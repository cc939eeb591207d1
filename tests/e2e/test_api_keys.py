"""API keys on the public gRPC API, against a ring launched with two keys
(``keyed_ring``, tests/e2e/conftest.py, which test_reliability_overload.py shares).

One key comes from ``--api-key``, the other from ``--api-key-file`` (a rotation: both are
valid). Every RPC of ``ringserve.v1.Tokenizer`` ends UNAUTHENTICATED without a key and
with a wrong one, and succeeds with either key; a refused Generate is never tokenized, a
refused Abort does not stop the request it names; health and reflection stay open; the
gateway works with the key; neither key appears in any log or service command line.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from ringserve.apikeys import MISSING, WRONG
from ringserve.client import AsyncRingserveClient, RingserveClient, chat_request
from ringserve.v1 import common_pb2, kv_events_pb2, lora_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tests.helpers.ring_requests import API_KEYS, bearer, chat

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."
SERVICE = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"]


# One valid request per RPC of the public service (the test fails when an RPC is added
# without a line here).
REQUESTS = {
    "Generate": chat_request(PARIS, max_new_tokens=4, temperature=0.0),
    "Abort": tokenizer_pb2.AbortRequest(rid="not-in-flight"),
    "GetModelInfo": common_pb2.Empty(),
    "Tokenize": tokenizer_pb2.TokenizeRequest(text="Hello"),
    "Detokenize": tokenizer_pb2.DetokenizeRequest(ids=[19556]),
    "TokenPieces": tokenizer_pb2.TokenIds(ids=[19556]),
    "GetLoad": common_pb2.Empty(),
    "GetClusterLoad": common_pb2.Empty(),
    "GetReadiness": common_pb2.Empty(),
    "SubscribeKvEvents": kv_events_pb2.SubscribeKvEventsRequest(snapshot=True),
    "FlushCache": common_pb2.Empty(),
    "Embed": tokenizer_pb2.EmbedRequest(inputs=[tokenizer_pb2.EmbedInput(text="Hello")]),
    "ListLoraAdapters": common_pb2.Empty(),
    # With a valid key these two reach the scheduler and are refused there (no such adapter):
    # past the key check, and nothing changes.
    "LoadLoraAdapter": lora_pb2.LoadLoraAdapterRequest(lora_name="absent", lora_path="/nonexistent/adapter"),
    "UnloadLoraAdapter": lora_pb2.UnloadLoraAdapterRequest(lora_name="absent"),
}
# The refusal each of those gets with a valid key.
REFUSED_PAST_THE_KEY = {"LoadLoraAdapter": grpc.StatusCode.INVALID_ARGUMENT,
                        "UnloadLoraAdapter": grpc.StatusCode.NOT_FOUND}


@pytest.fixture
def ring(keyed_ring):
    return keyed_ring


def call(stub: tokenizer_pb2_grpc.TokenizerStub, method: str, metadata) -> list:
    """Call ``method`` with its request from REQUESTS; its responses (a list: Generate streams)."""
    response = getattr(stub, method)(REQUESTS[method], timeout=60, metadata=metadata)
    if method == "SubscribeKvEvents":  # a subscription: its first batch (the snapshot), then leave
        first = next(response)
        response.cancel()
        return [first]
    return list(response) if method == "Generate" else [response]


def refusal(stub: tokenizer_pb2_grpc.TokenizerStub, method: str, metadata) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(stub, method, metadata)
    return info.value.code(), info.value.details()


def tokenized_calls(ring) -> float:
    """Generate calls the tokenizer has rendered and tokenized so far."""
    return sum(v for (name, _), v in ring.scrape("tokenizer").items()
               if name == "ringserve:request_tokenize_time_seconds_count")


def test_every_rpc_needs_a_valid_key(ring):
    assert set(REQUESTS) == set(SERVICE.methods_by_name)
    tokenized = tokenized_calls(ring)
    with grpc.insecure_channel(ring.tokenizer) as ch:
        stub = tokenizer_pb2_grpc.TokenizerStub(ch)
        for method in REQUESTS:
            assert refusal(stub, method, ()) == (grpc.StatusCode.UNAUTHENTICATED, MISSING), method
            for wrong in (bearer("sk-e2e-wrong"), bearer(API_KEYS[0][:-1]), (("authorization", API_KEYS[0]),),
                          (("authorization", f"Basic {API_KEYS[0]}"),)):
                assert refusal(stub, method, wrong) == (grpc.StatusCode.UNAUTHENTICATED, WRONG), (method, wrong)
        assert tokenized_calls(ring) == tokenized  # refused before any work
        for key in API_KEYS:
            out = {method: call(stub, method, bearer(key)) for method in REQUESTS if method not in REFUSED_PAST_THE_KEY}
            assert {m: refusal(stub, m, bearer(key))[0] for m in REFUSED_PAST_THE_KEY} == REFUSED_PAST_THE_KEY
            assert out["Generate"][-1].finish_reason.type == common_pb2.FINISH_LENGTH
            assert out["Generate"][-1].completion_tokens == 4
            assert out["Abort"] == [tokenizer_pb2.AbortResponse(found=False)]
            assert out["GetModelInfo"][0].served_model_name == ring.model_name
            assert list(out["Tokenize"][0].input_ids) == [19556]
            assert out["Detokenize"][0].text == "Hello" and list(out["TokenPieces"][0].texts) == ["Hello"]
            assert out["GetLoad"][0].req_states == 0
            assert len(out["GetClusterLoad"][0].schedulers) == 1
            assert out["GetReadiness"] == [tokenizer_pb2.Readiness(ready=True, replicas=1)]
            assert out["SubscribeKvEvents"][0].snapshot and out["FlushCache"] == [common_pb2.Empty()]
            assert len(out["Embed"][0].embeddings) == 1 and out["Embed"][0].prompt_tokens == 1
            assert out["ListLoraAdapters"][0].adapters == [] and out["ListLoraAdapters"][0].max_loras == 4
    assert tokenized_calls(ring) == tokenized + 2
    ring.wait_idle()


def test_abort_without_the_key_does_not_stop_a_request(ring):
    with RingserveClient(ring.tokenizer, api_key=API_KEYS[0]) as client:
        stream = client.chat(PARIS, rid="victim", max_new_tokens=24, temperature=0.0, ignore_eos=True)
        first = next(stream)
        assert first.rid == "victim" and first.finish_reason is None
        with grpc.insecure_channel(ring.tokenizer) as ch:
            stub = tokenizer_pb2_grpc.TokenizerStub(ch)
            for metadata, details in (((), MISSING), (bearer("sk-e2e-wrong"), WRONG)):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Abort(tokenizer_pb2.AbortRequest(rid="victim"), timeout=30, metadata=metadata)
                assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, details)
        last = list(stream)[-1]
        assert (last.finish_reason, last.completion_tokens) == ("length", 24)
    ring.wait_idle()


def test_typed_client_sync_and_async(ring):
    with RingserveClient(ring.tokenizer, api_key=API_KEYS[1]) as client:
        assert "".join(c.text for c in client.chat(PARIS, max_new_tokens=16, temperature=0.0, timeout_s=60)) == ANSWER
    with RingserveClient(ring.tokenizer) as client, pytest.raises(grpc.RpcError) as info:
        client.model_info(timeout_s=30)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

    async def async_chat() -> str:
        async with AsyncRingserveClient(ring.tokenizer, api_key=API_KEYS[0]) as aclient:
            chunks = aclient.chat(PARIS, max_new_tokens=16, temperature=0.0, timeout_s=60)
            return "".join([c.text async for c in chunks])

    assert asyncio.run(async_chat()) == ANSWER


def test_example_script_with_a_key(ring):
    """examples/grpc_chat.py: the sync then the async client, the key from $RINGSERVE_API_KEY."""
    example = Path(__file__).resolve().parents[2] / "examples" / "grpc_chat.py"
    env = {k: v for k, v in os.environ.items() if k != "RINGSERVE_API_KEY"}
    ok = subprocess.run([sys.executable, str(example), ring.tokenizer, "What is the capital of France?", "--timeout",
                         "120"], capture_output=True, text=True, timeout=300,
                        env={**env, "RINGSERVE_API_KEY": API_KEYS[1]})
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count(f"{ANSWER}\n[finish_reason=stop, tokens=8]") == 2, ok.stdout
    refused = subprocess.run([sys.executable, str(example), ring.tokenizer], capture_output=True, text=True,
                             timeout=300, env=env)
    assert refused.returncode == 1 and "StatusCode.UNAUTHENTICATED" in refused.stderr


def scheduler_aborts(ring) -> float:
    return sum(v for (name, labels), v in ring.scrape("scheduler").items()
               if name == "ringserve:scheduler_requests_finished_total" and ("finished_reason", "abort") in labels)


def test_deadline_and_cancellation_abort_the_request(ring):
    """docs/grpc.md's promise to direct clients: a deadline that passes, or a stream closed
    early, aborts the request in the scheduler and frees every service's state."""
    aborts = scheduler_aborts(ring)
    with RingserveClient(ring.tokenizer, api_key=API_KEYS[0]) as client:
        with pytest.raises(grpc.RpcError) as info:
            list(client.chat(PARIS, max_new_tokens=2000, ignore_eos=True, timeout_s=2))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        ring.wait_idle()
        stream = client.chat(PARIS, max_new_tokens=2000, ignore_eos=True)
        assert next(stream).finish_reason is None
        stream.close()
        ring.wait_idle()
    assert scheduler_aborts(ring) == aborts + 2


@pytest.mark.parametrize("service", ["tokenizer", "scheduler", "detokenizer"])
def test_health_and_reflection_stay_open(ring, service):
    with grpc.insecure_channel(getattr(ring, service)) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = list(refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    names = {s.name for s in responses[0].list_services_response.service}
    assert {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    assert (SERVICE.full_name in names) == (service == "tokenizer")


def test_gateway_passes_the_key(ring):
    for key in API_KEYS:
        r = httpx.post(f"{ring.base_url}/v1/chat/completions", json=chat(ring, max_tokens=16),
                       headers={"Authorization": f"Bearer {key}"}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == ANSWER
    r = httpx.get(f"{ring.base_url}/get_load", headers={"Authorization": f"Bearer {API_KEYS[1]}"}, timeout=30)
    assert r.status_code == 200 and len(r.json()["tokenizer"]) == 1
    r = httpx.post(f"{ring.base_url}/v1/chat/completions", json=chat(ring, max_tokens=16), timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{ring.base_url}/health", timeout=30).status_code == 200


def test_log_requests_opts_in(ring):
    """With --log-requests (this ring has it) the gateway logs the request and its output text.
    (The ring of tests/e2e/test_reliability_limits.py, launched without it, checks the opposite.)"""
    marker = "quokka-marker-5d41402abc"
    ask = [{"role": "user", "content": f"Repeat this word exactly: {marker}"}]
    resp = httpx.post(f"{ring.base_url}/v1/chat/completions", json=chat(ring, ask, max_tokens=24),
                      headers={"Authorization": f"Bearer {API_KEYS[0]}"}, timeout=60)
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["message"]["content"]
    log = ring.log()
    assert marker in log
    assert repr(content) in log


def test_keys_never_logged_nor_on_a_command_line(ring):
    """Runs last in this module, after its other tests have written to the log (plus one request of its own)."""
    r = httpx.post(f"{ring.base_url}/v1/chat/completions", json=chat(ring, max_tokens=4),
                   headers={"Authorization": f"Bearer {API_KEYS[1]}"}, timeout=120)
    assert r.status_code == 200, r.text
    log = ring.log()
    assert "tokenizer" in log and "API key required (2 valid)" in log  # the services' output is there
    assert "request " in log  # --log-requests: the gateway logged the requests it served
    for key in API_KEYS:
        assert key not in log
        for piece in (key[:12], key[-8:]):  # nor any recognisable part of it
            assert piece not in log
    for name in ("gateway", "tokenizer"):
        with open(f"/proc/{ring.pid(name)}/cmdline", "rb") as f:
            cmdline = f.read().decode()
        assert "--api-key" not in cmdline and not any(key in cmdline for key in API_KEYS), name
