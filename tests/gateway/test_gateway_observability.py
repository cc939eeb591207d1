"""/metrics, /health_generate, logprobs of multi-token outputs, and the OpenAPI schema."""

from __future__ import annotations

import asyncio

import grpc
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHAT = "/v1/chat/completions"


async def _samples(client) -> dict[tuple[str, tuple], float]:
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted({"model_name": "smol", **labels}.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


async def test_metrics_count_a_streamed_n2_request_exactly(stack):
    o = stack.out
    stack.fake.reset(o("a", index=0, completion=1), o("b", index=1, completion=1),
                     o("c", index=0, finish="stop", completion=3), o("d", index=1, finish="length", completion=2))
    before = await _samples(stack.client)
    body = {"model": stack.model, "messages": [{"role": "user", "content": "x"}], "n": 2, "stream": True}
    r = await stack.client.post(CHAT, json=body)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    after = await _samples(stack.client)
    assert _delta(before, after, "ringserve:prompt_tokens_total") == 7  # once per prompt, not per choice
    assert _delta(before, after, "ringserve:generation_tokens_total") == 5  # 3 + 2
    assert _delta(before, after, "ringserve:request_success_total", finished_reason="stop") == 1
    assert _delta(before, after, "ringserve:request_success_total", finished_reason="length") == 1
    assert _delta(before, after, "ringserve:num_aborted_requests_total") == 0
    assert _delta(before, after, "ringserve:time_to_first_token_seconds_count") == 1
    assert _delta(before, after, "ringserve:e2e_request_latency_seconds_count") == 1
    # choice 0: 1 then 2 more tokens (2 ITL samples); choice 1: 1 then 1 more (1 sample)
    assert _delta(before, after, "ringserve:inter_token_latency_seconds_count") == 3
    assert after[("ringserve:gateway_requests_in_flight", (("model_name", "smol"),))] == 0


async def test_metrics_non_stream_and_abort(stack):
    o = stack.out
    stack.fake.reset(o("all", finish="stop", completion=4))
    before = await _samples(stack.client)
    body = {"model": stack.model, "prompt": "x"}
    assert (await stack.client.post("/v1/completions", json=body)).status_code == 200
    stack.fake.reset(o("gone", finish="abort", completion=2, status="CANCELLED"))
    assert (await stack.client.post("/v1/completions", json=body)).status_code == 200
    after = await _samples(stack.client)
    assert _delta(before, after, "ringserve:prompt_tokens_total") == 14
    assert _delta(before, after, "ringserve:generation_tokens_total") == 6
    assert _delta(before, after, "ringserve:request_success_total", finished_reason="stop") == 1
    assert _delta(before, after, "ringserve:num_aborted_requests_total") == 1
    assert _delta(before, after, "ringserve:time_to_first_token_seconds_count") == 0  # not streamed
    assert _delta(before, after, "ringserve:e2e_request_latency_seconds_count") == 2


async def test_metrics_count_a_client_disconnect_as_aborted(stack):
    stack.fake.reset(stack.out("a", completion=1), stack.Hang())
    before = await _samples(stack.client)
    body = {"model": stack.model, "messages": [{"role": "user", "content": "x"}], "stream": True}
    async with stack.client.stream("POST", CHAT, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break
    await asyncio.wait_for(stack.fake.cancelled.wait(), 5)
    for _ in range(100):
        after = await _samples(stack.client)
        if _delta(before, after, "ringserve:num_aborted_requests_total") == 1:
            break
        await asyncio.sleep(0.02)
    assert _delta(before, after, "ringserve:num_aborted_requests_total") == 1
    assert _delta(before, after, "ringserve:generation_tokens_total") == 1
    assert sum(_delta(before, after, "ringserve:request_success_total", finished_reason=r)
               for r in ("stop", "length")) == 0


@pytest.mark.parametrize("code,n,aborted", [(grpc.StatusCode.UNAVAILABLE, 2, 2),
                                             (grpc.StatusCode.DEADLINE_EXCEEDED, 1, 1),
                                             (grpc.StatusCode.INVALID_ARGUMENT, 1, 0)])
async def test_metrics_count_a_call_cut_off_before_its_first_output(stack, caplog, code, n, aborted):
    """A server error before the first output (a request timeout, a lost scheduler) cuts off
    every choice: counted as aborted, and logged; a refusal (4xx) is no request begun."""
    stack.fake.reset(stack.Fail(code, "gone"))
    before = await _samples(stack.client)
    body = {"model": stack.model, "messages": [{"role": "user", "content": "x"}], "n": n}
    r = await stack.client.post(CHAT, json=body)
    assert r.status_code == {0: 400}.get(aborted, 503 if code == grpc.StatusCode.UNAVAILABLE else 504)
    after = await _samples(stack.client)
    assert _delta(before, after, "ringserve:num_aborted_requests_total") == aborted
    logged = [rec.getMessage() for rec in caplog.records if "ended before its first output" in rec.getMessage()]
    assert len(logged) == (1 if aborted else 0), logged


async def test_health_generate_runs_one_uncounted_token(stack):
    stack.fake.reset(stack.out("pong", finish="length", completion=1))
    before = await _samples(stack.client)
    r = await stack.client.get("/health_generate")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    got = r.json()
    assert got["status"] == "ok" and got["text"] == "pong" and got["completion_tokens"] == 1
    req = stack.fake.requests[0]
    assert req.rid.startswith("health-generate-") and req.text
    sp = req.sampling_params
    assert sp.max_new_tokens == 1 and sp.ignore_eos and sp.HasField("temperature") and sp.temperature == 0
    after = await _samples(stack.client)
    assert _delta(before, after, "ringserve:generation_tokens_total") == 0


@pytest.mark.parametrize("step", ["fail", "no-token"])
async def test_health_generate_503_when_the_ring_fails(stack, step):
    if step == "fail":
        stack.fake.reset(stack.Fail(grpc.StatusCode.UNAVAILABLE, "the scheduler is not connected"))
    else:
        stack.fake.reset(stack.out("", finish="abort", completion=0, status="CANCELLED"))
    r = await stack.client.get("/health_generate")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["type"] == "service_unavailable_error" and err["code"] == "service_unavailable"
    if step == "fail":
        assert "the scheduler is not connected" in err["message"]


async def test_health_generate_503_on_timeout_and_cancels_the_probe(stack, quick_probe):
    stack.fake.reset(stack.Hang())
    r = await quick_probe.get("/health_generate")
    assert r.status_code == 503 and "0.3 s" in r.json()["error"]["message"]
    await asyncio.wait_for(stack.fake.cancelled.wait(), 5)


async def test_probes_and_metrics_need_no_api_key(stack, keyed):
    stack.fake.reset(stack.out("pong", finish="length", completion=1))
    assert (await keyed.get("/health_generate")).status_code == 200
    assert (await keyed.get("/metrics")).status_code == 200
    assert (await keyed.get("/v1/models")).status_code == 401


async def test_logprobs_of_several_tokens_in_one_output(stack):
    """One output carrying three tokens gives three logprob entries, fetched in one call."""
    o = stack.out("abc", finish="stop", completion=3)
    o.output_ids[:] = [5, 6, 5]
    o.output_token_logprobs.extend([-0.5, -0.25, -0.125])
    for t in (5, 6, 5):
        o.output_top_logprobs.add(token_ids=[t, 9], logprobs=[-0.5, -2.0])
    stack.fake.reset(o)
    stack.fake.pieces_requests.clear()
    body = {"model": stack.model, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
            "top_logprobs": 2, "stream": True}
    r = await stack.client.post(CHAT, json=body)
    chunks = [orjson.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    content = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
               for e in c["choices"][0]["logprobs"]["content"]]
    assert [(e["token"], e["logprob"]) for e in content] == [("<5>", -0.5), ("<6>", -0.25), ("<5>", -0.125)]
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    assert content[1]["bytes"] == list(b"<6>")
    assert len(stack.fake.pieces_requests) <= 1  # one batch call (none if cached already)
    assert all(len(set(ids)) == len(ids) for ids in stack.fake.pieces_requests)

    stack.fake.reset(o)
    body = {"model": stack.model, "prompt": "p", "logprobs": 2, "echo": True}
    lp = (await stack.client.post("/v1/completions", json=body)).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["<5>", "<6>", "<5>"] and lp["token_logprobs"] == [-0.5, -0.25, -0.125]
    assert lp["text_offset"] == [1, 4, 7]  # after the echoed prompt "p"
    assert lp["top_logprobs"][1] == {"<6>": -0.5, "<9>": -2.0}


async def test_openapi_declares_bodies_and_400_never_422(stack):
    schema = (await stack.client.get("/openapi.json")).json()
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            assert "422" not in op["responses"], (path, method)
            if method == "post":
                assert op["requestBody"]["required"], path
                assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
                    "/ErrorResponse")
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    chat_200 = schema["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(chat_200) == {"application/json", "text/event-stream"}


async def test_schema_fuzz_regressions(stack):
    """Inputs schemathesis found: values the proto cannot hold are 400s, never 500s; what is
    accepted is what the schema says (JSON types strict, 5.0 is an integer)."""
    chat = {"model": stack.model, "messages": [{"role": "user", "content": "x"}]}
    for extra, param in [({"max_tokens": 2**40}, "max_tokens"), ({"stop_token_ids": [2**31]}, "stop_token_ids"),
                         ({"stream": "true"}, "stream"), ({"max_tokens": "5"}, "max_tokens"),
                         ({"logit_bias": {str(2**40): 1}}, "logit_bias")]:
        r = await stack.client.post(CHAT, json={**chat, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    r = await stack.client.post("/v1/completions", json={"model": stack.model, "prompt": [2**70]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    stack.fake.reset(stack.out("ok", finish="stop"))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"maximum": 2**70}}}]
    r = await stack.client.post(CHAT, json={**chat, "tools": tools, "max_tokens": 5.0})
    assert r.status_code == 200, r.text
    assert str(2**70) in stack.fake.requests[0].chat.tools_json
    assert stack.fake.requests[0].sampling_params.max_new_tokens == 5
