"""Limits: token budget, request timeouts and gRPC deadlines, body and message sizes,
and no prompt or output in the logs.

One ring of its own with ``--max-queued-tokens 300``, ``--request-timeout 4``,
``--max-request-body-bytes 65536`` and ``--grpc-max-message-bytes 1048576``, its log kept
in a file. Every test ends by checking that each service is back to its baseline.
"""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import httpx
import pytest

from ringserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from tests.helpers.ring_requests import chat
from tests.helpers.ringstack import launched
from tests.helpers.sse_reader import sse_events
from tests.helpers.tiers import ring_fixture

BUDGET = 300
TIMEOUT_S = 4
BODY_LIMIT = 65536
MESSAGE_LIMIT = 1 << 20
MARKER = "quokka-marker-5d41402abc"


@ring_fixture(scope="module")
def ring(smollm2_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("limits") / "ring.log"
    with launched(smollm2_dir, "--max-queued-tokens", str(BUDGET), "--request-timeout", str(TIMEOUT_S),
                  "--max-request-body-bytes", str(BODY_LIMIT), "--grpc-max-message-bytes", str(MESSAGE_LIMIT),
                  log_path=log_path) as s:
        yield s


def generate_req(text: str, max_new_tokens: int) -> tokenizer_pb2.GenerateReqInput:
    return tokenizer_pb2.GenerateReqInput(
        rid=f"limits-{uuid.uuid4().hex}", text=text, stream=True,
        sampling_params=common_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True),
    )


class Hold:
    """A long gRPC Generate running in a thread until ``release()`` cancels it."""

    def __init__(self, ring, text: str):
        self.channel = grpc.insecure_channel(ring.tokenizer)
        self.call = tokenizer_pb2_grpc.TokenizerStub(self.channel).Generate(generate_req(text, 2000))
        self.outputs = 0
        self.prompt_tokens = 0
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for out in self.call:
                self.outputs += 1
                self.prompt_tokens = out.prompt_tokens
        except grpc.RpcError:
            pass

    def release(self) -> None:
        self.call.cancel()
        self.thread.join(10)
        self.channel.close()


def prompt_tokens(ring, body: dict) -> int:
    resp = httpx.post(f"{ring.base_url}/v1/tokenize", json={"model": ring.model_name, "messages": body["messages"]})
    assert resp.status_code == 200, resp.text
    return resp.json()["count"]


def wait_running(ring, n: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while ring.scheduler_load().num_running_reqs != n:
        assert time.monotonic() < deadline, ring.scheduler_load()
        time.sleep(0.05)


def test_token_budget_refuses_with_429(ring):
    ring.wait_idle()
    big = chat(ring, [{"role": "user", "content": "word " * 280}], max_tokens=4)
    big_len = prompt_tokens(ring, big)
    small = chat(ring, max_tokens=8)

    hold = Hold(ring, "Tell me a story about a lighthouse.")
    try:
        wait_running(ring, 1)
        while not hold.prompt_tokens:
            time.sleep(0.05)
        held = hold.prompt_tokens
        assert held + big_len > BUDGET >= held + prompt_tokens(ring, small)
        for stream in (False, True):
            t0 = time.monotonic()
            resp = httpx.post(f"{ring.base_url}/v1/chat/completions", json={**big, "stream": stream}, timeout=30)
            took = time.monotonic() - t0
            assert resp.status_code == 429, resp.text
            assert resp.headers["content-type"] == "application/json"
            assert int(resp.headers["retry-after"]) > 0
            error = resp.json()["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "server_overloaded")
            assert error["message"] == (
                f"the server is overloaded: {held} prompt tokens are already held and this request has "
                f"{big_len} (--max-queued-tokens {BUDGET}); retry later")
            assert took < 2.0, took
        # Within the budget: served while the long request runs.
        resp = httpx.post(f"{ring.base_url}/v1/chat/completions", json=small, timeout=30)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
        assert hold.outputs > 0
    finally:
        hold.release()
    ring.wait_idle()
    # An idle scheduler admits any request, however large against the budget.
    resp = httpx.post(f"{ring.base_url}/v1/chat/completions", json=big, timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == big_len
    ring.wait_idle()


def test_grpc_deadline_aborts_and_releases(ring):
    ring.wait_idle()
    before = ring.scheduler_load().num_aborted_reqs
    outputs = 0
    with grpc.insecure_channel(ring.tokenizer) as ch:
        with pytest.raises(grpc.RpcError) as info:
            for _ in tokenizer_pb2_grpc.TokenizerStub(ch).Generate(generate_req("Write a very long story.", 2000),
                                                                  timeout=2.0):
                outputs += 1
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert outputs > 0  # it was running, not refused
    _, sched, _ = ring.wait_idle(timeout_s=10)
    assert sched.num_aborted_reqs == before + 1


async def test_http_request_timeout_is_504(ring):
    ring.wait_idle()
    before = ring.scheduler_load().num_aborted_reqs
    long = chat(ring, [{"role": "user", "content": "Write a very long story."}], max_tokens=2000, ignore_eos=True)
    message = f"the request did not finish within {TIMEOUT_S:g} s (--request-timeout)"
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=60) as client:
        resp = await client.post("/v1/chat/completions", json=long)
        assert resp.status_code == 504, resp.text
        assert resp.json() == {"error": {"message": message, "type": "timeout_error", "param": None,
                                         "code": "timeout"}}
        ring.wait_idle(timeout_s=10)

        resp = await client.post("/v1/chat/completions", json={**long, "stream": True})
        events = sse_events(resp)  # framing checked: ends with one [DONE]
        assert events[-1] == {"error": {"message": message, "type": "timeout_error", "param": None,
                                        "code": "timeout"}}
        assert len(events) > 2 and all("choices" in e for e in events[:-1])
    _, sched, _ = ring.wait_idle(timeout_s=10)
    assert sched.num_aborted_reqs == before + 2


def test_body_over_the_limit_is_413_before_parsing(ring):
    url = f"{ring.base_url}/v1/chat/completions"
    body = b'{"model": "x", "messages": [' + b" " * BODY_LIMIT + b"]}"
    expected = {"type": "invalid_request_error", "param": None, "code": "request_too_large"}

    resp = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 413, resp.text
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert error == {**expected, "message": f"the request body ({len(body)} bytes) exceeds the limit of "
                                            f"{BODY_LIMIT} bytes (--max-request-body-bytes)"}

    def chunked():  # no Content-Length: Transfer-Encoding chunked
        for i in range(0, len(body), 4096):
            yield body[i:i + 4096]

    resp = httpx.post(url, content=chunked(), headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 413, resp.text
    assert resp.json()["error"] == {**expected, "message": f"the request body (over {BODY_LIMIT} bytes so far) "
                                                           f"exceeds the limit of {BODY_LIMIT} bytes "
                                                           f"(--max-request-body-bytes)"}

    # A chunked body under the limit is parsed and served as usual.
    small = httpx.Request("POST", url, json=chat(ring, max_tokens=8)).content
    resp = httpx.post(url, content=iter([small[:10], small[10:]]), headers={"content-type": "application/json"},
                      timeout=30)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    ring.wait_idle()


def test_grpc_message_over_the_limit_is_resource_exhausted(ring):
    with grpc.insecure_channel(ring.tokenizer) as ch:
        stub = tokenizer_pb2_grpc.TokenizerStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(generate_req("a" * (MESSAGE_LIMIT + 1), 4), timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in info.value.details()
        # The server's limit holds for a client whose own limit is larger.
    with grpc.insecure_channel(ring.tokenizer, options=[("grpc.max_send_message_length", 4 * MESSAGE_LIMIT)]) as ch:
        with pytest.raises(grpc.RpcError) as info:
            list(tokenizer_pb2_grpc.TokenizerStub(ch).Generate(generate_req("a" * (MESSAGE_LIMIT + 1), 4), timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in info.value.details()
    assert ring.tokenizer_load().req_states == 0


def test_prompts_and_outputs_stay_out_of_the_logs(ring):
    """A request with a unique marker, served, refused (context overflow) and timed out:
    neither the marker nor the generated text reaches any service's log."""
    ring.wait_idle()
    url = f"{ring.base_url}/v1/chat/completions"
    ask = [{"role": "user", "content": f"Repeat this word exactly: {MARKER}"}]
    resp = httpx.post(url, json=chat(ring, ask, max_tokens=24), timeout=30)
    assert resp.status_code == 200, resp.text
    content = resp.json()["choices"][0]["message"]["content"]
    resp = httpx.post(url, json=chat(ring, [{"role": "user", "content": f"{MARKER} " * 2000}], max_tokens=4),
                      timeout=30)
    assert resp.status_code == 400, resp.text
    resp = httpx.post(url, json=chat(ring, ask, max_tokens=2000, ignore_eos=True), timeout=30)
    assert resp.status_code == 504, resp.text
    ring.wait_idle(timeout_s=10)
    log = ring.log()
    assert "ringserve: serving" in log  # the log is the ring's
    assert MARKER not in log
    assert MARKER[:12] not in log
    assert len(content) > 8 and content not in log, content

