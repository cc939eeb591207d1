"""Against the running stack: /health_generate, /metrics counter deltas, and
logprobs that line up token by token with the text."""

from __future__ import annotations

import asyncio
import math

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

CHAT = "/v1/chat/completions"
COUNT = "Count from 1 to 50, separated by commas."


def _metrics(base_url: str) -> dict[tuple[str, tuple], float]:
    r = httpx.get(f"{base_url}/metrics", timeout=10)
    assert r.status_code == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
    }


def _delta(stack, before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted({"model_name": stack.model_name, **labels}.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def _chunks(text: str) -> list[dict]:
    return [orjson.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]


def test_health_generate_runs_one_token_through_the_ring(stack):
    before = _metrics(stack.base_url)
    r = httpx.get(f"{stack.base_url}/health_generate", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    got = r.json()
    assert got["status"] == "ok" and got["completion_tokens"] == 1 and got["latency_s"] > 0
    after = _metrics(stack.base_url)
    assert _delta(stack, before, after, "ringserve:generation_tokens_total") == 0  # probes are not counted
    stack.wait_idle()


def test_metrics_deltas_after_known_requests(stack):
    before = _metrics(stack.base_url)
    # A streamed chat request of exactly 5 tokens, with the running usage in every chunk.
    body = {"model": stack.model_name, "messages": [{"role": "user", "content": COUNT}], "max_tokens": 5,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    r = httpx.post(f"{stack.base_url}{CHAT}", json=body, timeout=60)
    chunks = _chunks(r.text)
    usage = chunks[-1]["usage"]
    first_tokens = min(c["usage"]["completion_tokens"] for c in chunks if c["usage"]["completion_tokens"])
    # A non-streamed completions request with n=2 that stops on a stop string or at 6 tokens.
    body2 = {"model": stack.model_name, "prompt": "1, 2, 3,", "max_tokens": 6, "n": 2, "temperature": 0}
    got2 = httpx.post(f"{stack.base_url}/v1/completions", json=body2, timeout=60).json()
    after = _metrics(stack.base_url)

    assert usage["completion_tokens"] == 5
    assert _delta(stack, before, after, "ringserve:prompt_tokens_total") == (
        usage["prompt_tokens"] + got2["usage"]["prompt_tokens"])
    assert _delta(stack, before, after, "ringserve:generation_tokens_total") == 5 + got2["usage"]["completion_tokens"]
    reasons = ["length"] + [c["finish_reason"] for c in got2["choices"]]
    for reason in ("stop", "length"):
        assert _delta(stack, before, after, "ringserve:request_success_total", finished_reason=reason) == (
            reasons.count(reason))
    assert _delta(stack, before, after, "ringserve:num_aborted_requests_total") == 0
    assert _delta(stack, before, after, "ringserve:time_to_first_token_seconds_count") == 1  # streamed only
    assert _delta(stack, before, after, "ringserve:inter_token_latency_seconds_count") == 5 - first_tokens
    assert _delta(stack, before, after, "ringserve:e2e_request_latency_seconds_count") == 2
    assert _delta(stack, before, after, "ringserve:e2e_request_latency_seconds_sum") > 0
    stack.wait_idle()


async def test_metrics_count_a_disconnect_as_aborted(stack):
    before = _metrics(stack.base_url)
    body = {"model": stack.model_name, "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 500, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as client:
        async with client.stream("POST", CHAT, json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    break
    stack.wait_idle()
    after = _metrics(stack.base_url)
    assert _delta(stack, before, after, "ringserve:num_aborted_requests_total") == 1
    assert _delta(stack, before, after, "ringserve:request_success_total", finished_reason="length") == 0


def _check_chat_entries(content: list[dict], top_n: int) -> None:
    for e in content:
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == top_n
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"] or "\ufffd" in e["token"]
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        # greedy: the chosen token is the top-1 one
        assert e["top_logprobs"][0]["token"] == e["token"]
        assert math.isclose(e["top_logprobs"][0]["logprob"], e["logprob"], abs_tol=1e-5)


async def test_chat_logprobs_line_up_with_the_text(stack):
    base = {"model": stack.model_name, "max_tokens": 16, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    prompts = [COUNT, "Say 'café 社区 👍' twice."]
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
        plain = [client.post(CHAT, json={**base, "messages": [{"role": "user", "content": p}]}) for p in prompts]
        streamed = [client.post(CHAT, json={**base, "messages": [{"role": "user", "content": p}], "stream": True,
                                            "stream_options": {"include_usage": True}}) for p in prompts]
        results = await asyncio.gather(*plain, *streamed)
    for r in results[: len(prompts)]:
        body = r.json()
        choice = body["choices"][0]
        content = choice["logprobs"]["content"]
        assert len(content) == body["usage"]["completion_tokens"]
        _check_chat_entries(content, 3)
        if choice["finish_reason"] == "length":  # no stop token to trim
            assert b"".join(bytes(e["bytes"]) for e in content).decode() == choice["message"]["content"]
            if "\ufffd" not in "".join(e["token"] for e in content):
                assert "".join(e["token"] for e in content) == choice["message"]["content"]
    for r, whole in zip(results[len(prompts):], results[: len(prompts)], strict=True):
        chunks = _chunks(r.text)
        content = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
        assert len(content) == chunks[-1]["usage"]["completion_tokens"]
        _check_chat_entries(content, 3)
        expected = whole.json()["choices"][0]["logprobs"]["content"]
        assert [e["token"] for e in content] == [e["token"] for e in expected]
        assert [e["logprob"] for e in content] == pytest.approx([e["logprob"] for e in expected], abs=1e-3)
    stack.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_tokens_offsets_and_echo(stack, stream):
    prompt = "The numbers 1, 2, 3, 4,"
    body = {"model": stack.model_name, "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 2,
            "echo": True, "ignore_eos": True, "stream": stream}
    r = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    if stream:
        chunks = _chunks(r.text)
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        tokens = [t for lp in lps for t in lp["tokens"]]
        token_lps = [x for lp in lps for x in lp["token_logprobs"]]
        tops = [x for lp in lps for x in lp["top_logprobs"]]
        offsets = [x for lp in lps for x in lp["text_offset"]]
    else:
        choice = r.json()["choices"][0]
        text, lp = choice["text"], choice["logprobs"]
        tokens, token_lps, tops, offsets = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"]
    # echo scores the prompt's tokens too: they come first, the first without a logprob.
    n_prompt = len(tokens) - 10
    assert text.startswith(prompt) and n_prompt > 0 and "".join(tokens[:n_prompt]) == prompt
    assert "".join(tokens) == text
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert token_lps[0] is None and tops[0] is None
    assert all(x <= 0 for x in token_lps[1:])
    for top in tops[1:n_prompt]:
        assert len(top) in (1, 2)  # a prompt token need not be among the top 2
    for token, lp, top in zip(tokens[n_prompt:], token_lps[n_prompt:], tops[n_prompt:], strict=True):
        assert len(top) in (1, 2) and max(top.values()) == pytest.approx(lp, abs=1e-5) and top.get(token) is not None
    stack.wait_idle()
