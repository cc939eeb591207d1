"""No request can stall another, on the shared ring: while one huge request is in flight the
gateway's ``/health`` answers 200 in under 100 ms and a short chat is served, and the huge
request gets its 400 (or INVALID_ARGUMENT) quickly. Bodies are encoded before the clock starts
and sent from threads whose socket writes release the GIL, so the probes time the ring, not
this process.

The 100 ms bound is the issue's; on 2 cores that other test runs share, a starved process can
miss it on its own, so the bound must hold in one of two tries: a stall (the huge request parsed
or tokenized on the event loop) is seconds and fails both.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from ringserve.v1 import tokenizer_pb2

HEALTH_BOUND_S = 0.1
REFUSAL_BOUND_S = 3.0  # on main: 3-26 s, the prompt tokenized on the event loop first
LONGEST = 81  # characters in SmolLM2's longest token
BOUND = 8191 * LONGEST
WORDS = "word " * 3_000_000


def too_long(what: str, chars: int, param: str) -> str:
    return (f"This model's maximum context length is 8192 tokens. However, your {what} {chars} characters, and more "
            f"than {BOUND} characters cannot fit (8191 tokens of at most 81 characters each). Please reduce the "
            f"length of the {param}.")


class HealthProbes:
    """GET /health every 10 ms from a thread: (start, latency, status) of each."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.probes: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                status = client.get(f"{self.base_url}/health").status_code
                self.probes.append((started, time.monotonic() - started, status))
                time.sleep(0.01)

    def __enter__(self) -> HealthProbes:
        self._thread.start()
        time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(15)

    def during(self, start: float, end: float) -> list[tuple[float, int]]:
        return [(latency, status) for t, latency, status in self.probes if start <= t <= end]


def short_chat(stack) -> str:
    resp = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60, json={
        "model": stack.model_name, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module", autouse=True)
def warm(stack):
    """A first short chat: a ring's first request after launch warms the scheduler, which these
    tests do not time."""
    assert short_chat(stack) == "The capital of France"


def beside_a_huge_request(stack, send: Callable[[], object]) -> object:
    """``send()`` with /health probed and a short chat sent meanwhile; returns what ``send`` did."""
    # This process's own collections would pause the probe thread and be timed as the ring's.
    gc.collect()
    gc.disable()
    try:
        result, window = _beside(stack, send)
        if max(window)[0] >= HEALTH_BOUND_S:
            result, window = _beside(stack, send)  # one probe preempted past the bound: the second try decides
        assert max(window)[0] < HEALTH_BOUND_S, window
        return result
    finally:
        gc.enable()


def _beside(stack, send: Callable[[], object]) -> tuple[object, list[tuple[float, int]]]:
    """What ``send`` did, and the (latency, status) of the /health probes meanwhile."""
    with HealthProbes(stack.base_url) as probes, ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        huge = pool.submit(send)
        time.sleep(0.02)  # the huge request is on its way first
        chat = pool.submit(short_chat, stack)
        result = huge.result(timeout=120)
        took = time.monotonic() - started
        assert chat.result(timeout=120) == "The capital of France"
        window = probes.during(started, time.monotonic())
    assert len(window) >= 3, probes.probes
    assert {status for _, status in window} == {200}, window
    assert took < REFUSAL_BOUND_S, took
    stack.wait_idle(timeout_s=10)
    return result, window


def http(stack, path: str, body: dict) -> Callable[[], httpx.Response]:
    raw = json.dumps(body).encode()
    return lambda: httpx.post(f"{stack.base_url}{path}", content=raw, timeout=120,
                              headers={"content-type": "application/json"})


def rpc(stack, method: str, req) -> Callable[[], tuple[grpc.StatusCode, str, dict]]:
    """A raw-bytes call to the tokenizer (encoded now): (status, details, trailing metadata)."""
    raw = req.SerializeToString()
    path = f"/ringserve.v1.Tokenizer/{method}"

    def call() -> tuple[grpc.StatusCode, str, dict]:
        with grpc.insecure_channel(stack.tokenizer, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            try:
                if method == "Generate":
                    list(ch.unary_stream(path)(raw, timeout=60))
                else:
                    ch.unary_unary(path)(raw, timeout=60)
            except grpc.RpcError as err:
                return err.code(), err.details(), dict(err.trailing_metadata())
        raise AssertionError(f"{method} was not refused")

    return call


def error_of(resp: httpx.Response) -> dict:
    assert resp.status_code == 400, resp.text[:500]
    return resp.json()["error"]


def test_a_15_mb_chat(stack):
    resp = beside_a_huge_request(stack, http(stack, "/v1/chat/completions", {
        "model": stack.model_name, "max_tokens": 5, "messages": [{"role": "user", "content": WORDS}]}))
    assert error_of(resp) == {"message": too_long("messages have", 15_000_000, "messages"),
                              "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}


def test_a_chat_of_50000_messages(stack):
    resp = beside_a_huge_request(stack, http(stack, "/v1/chat/completions", {
        "model": stack.model_name, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}] * 50_000}))
    assert error_of(resp)["message"] == "Invalid 'messages': 50000 messages are more than the 2048 a request may hold"


def test_a_4_mb_tokenize(stack):
    resp = beside_a_huge_request(stack, http(stack, "/v1/tokenize", {
        "model": stack.model_name, "prompt": WORDS[:4_000_000]}))
    assert error_of(resp) == {"message": too_long("prompt has", 4_000_000, "prompt"),
                              "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded"}


def test_a_prompt_at_the_character_bound_is_tokenized_off_the_loop(stack):
    # Not refused by the bound: tokenized on a worker thread (0.5-3 s here), then by its count.
    resp = beside_a_huge_request(stack, http(stack, "/v1/completions", {
        "model": stack.model_name, "max_tokens": 5, "prompt": WORDS[:BOUND]}))
    assert error_of(resp)["message"] == (
        "This model's maximum context length is 8192 tokens. However, you requested 132700 tokens (132695 in the "
        "prompt, 5 in the completion). Please reduce the length of the prompt or completion.")


@pytest.mark.parametrize("method, req, message", [
    ("Generate", tokenizer_pb2.GenerateReqInput(text=WORDS[:10_000_000]), too_long("prompt has", 10_000_000, "prompt")),
    ("Tokenize", tokenizer_pb2.TokenizeRequest(text=WORDS[:10_000_000]), too_long("prompt has", 10_000_000, "prompt")),
    ("Generate", tokenizer_pb2.GenerateReqInput(chat=tokenizer_pb2.ChatInput(
        messages=[tokenizer_pb2.ChatMessage(role="user", content="hi")] * 50_000)),
     "This model's maximum context length is 8192 tokens. However, you sent 50000 messages, and more than 8191 "
     "messages cannot fit (each takes at least one token). Please reduce the number of messages."),
], ids=["generate-10MB", "tokenize-10MB", "generate-50000-messages"])
def test_grpc(stack, method, req, message):
    code, details, trailers = beside_a_huge_request(stack, rpc(stack, method, req))
    assert (code, details, trailers["code"]) == (grpc.StatusCode.INVALID_ARGUMENT, message, "context_length_exceeded")
