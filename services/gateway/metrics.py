"""Gateway-side Prometheus metrics (``GET /metrics``), named like vLLM's with a ``ringserve:``
prefix and a ``model_name`` label.

What is measured and when (the gateway sees outputs, not engine steps):

- ``ringserve:time_to_first_token_seconds``: from the Generate call's start to the first
  output carrying tokens, once per Generate call. Streamed requests only: a non-streamed
  call's first output is its last, so its TTFT would be its E2E latency.
- ``ringserve:inter_token_latency_seconds``: per choice, the time between two outputs divided
  evenly over the tokens of the later one (several tokens arrive in one output when the
  tokenizer coalesces a backlog). Streamed requests only.
- ``ringserve:e2e_request_latency_seconds``: from the call's start to its last output, once
  per Generate call that finished every choice.
- ``ringserve:prompt_tokens_total``: ``usage.prompt_tokens``: once per prompt (n > 1 choices
  share it).
- ``ringserve:generation_tokens_total``: ``usage.completion_tokens``: summed over choices.
- ``ringserve:request_success_total{finished_reason}``: choices that ended with stop or length.
- ``ringserve:num_aborted_requests_total``: choices that ended with abort, or whose call ended
  before they finished (client disconnect, error).
- ``ringserve:gateway_requests_in_flight``: Generate calls open now (the scheduler's
  ``ringserve:num_requests_running`` is its running batch).

Each app has its own registry, so several gateways (tests) can live in one process.
``/health_generate`` probes are not counted (as in SGLang).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ringserve.v1 import common_pb2, tokenizer_pb2

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_FINISHED = {common_pb2.FINISH_STOP: "stop", common_pb2.FINISH_LENGTH: "length"}


class GatewayMetrics:
    """The gateway's metric families in their own registry. ``model_name`` is fixed on the
    first request that knows it (the served name can come from the tokenizer)."""

    def __init__(self, model_name: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name or ""
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("ringserve:time_to_first_token_seconds", "Time to first token (streamed requests).",
                              labels, registry=r, buckets=_TTFT_BUCKETS)
        self.itl = Histogram("ringserve:inter_token_latency_seconds", "Time between tokens (streamed requests).",
                             labels, registry=r, buckets=_ITL_BUCKETS)
        self.e2e = Histogram("ringserve:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, registry=r, buckets=_E2E_BUCKETS)
        self.prompt_tokens = Counter("ringserve:prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("ringserve:generation_tokens", "Tokens generated.", labels, registry=r)
        self.success = Counter("ringserve:request_success", "Choices finished by stop or length.",
                               [*labels, "finished_reason"], registry=r)
        self.aborted = Counter("ringserve:num_aborted_requests", "Choices aborted or cut off.", labels, registry=r)
        self.running = Gauge("ringserve:gateway_requests_in_flight", "Generate calls in flight.", labels, registry=r)

    def exposition(self) -> bytes:
        """The Prometheus text format of every family."""
        return generate_latest(self.registry)

    def cut_off(self, n: int) -> None:
        """A Generate call of ``n`` choices ended before its first output (a server error, the
        client gone): they count as aborted, as a call cut off later counts its unfinished
        ones. Not counted before the served name is known (no label)."""
        if self.model_name:
            self.aborted.labels(self.model_name).inc(n)

    def request(self, n: int, stream: bool, started: float) -> RequestMetrics:
        """A tracker for one Generate call with ``n`` choices started at ``started`` (monotonic)."""
        return RequestMetrics(self, n, stream, started)


class RequestMetrics:
    """Feeds one Generate call's outputs into the families; ``close`` is idempotent."""

    def __init__(self, metrics: GatewayMetrics, n: int, stream: bool, started: float) -> None:
        self._m = metrics
        self._label = metrics.model_name
        self._n = n
        self._stream = stream
        self._started = started
        self._last: dict[int, float] = {}  # choice -> time of its last output
        self._tokens: dict[int, int] = {}  # choice -> completion tokens counted
        self._finished: set[int] = set()
        self._prompt_counted = False
        self._first_token_seen = False
        self._closed = False
        # The per-output families' children, looked up once (a labels() call per token is not free).
        self._generation_tokens = metrics.generation_tokens.labels(self._label)
        self._itl = metrics.itl.labels(self._label)
        metrics.running.labels(self._label).inc()

    def on_output(self, out: tokenizer_pb2.GenerateOutput) -> None:
        now = time.monotonic()
        m, label, i = self._m, self._label, out.index
        if not self._prompt_counted and out.prompt_tokens:
            m.prompt_tokens.labels(label).inc(out.prompt_tokens)
            self._prompt_counted = True
        new = out.completion_tokens - self._tokens.get(i, 0)
        if new > 0:
            self._generation_tokens.inc(new)
            self._tokens[i] = out.completion_tokens
            if self._stream:
                if not self._first_token_seen:
                    m.ttft.labels(label).observe(now - self._started)
                    self._first_token_seen = True
                if i in self._last:
                    gap = (now - self._last[i]) / new
                    for _ in range(new):
                        self._itl.observe(gap)
            self._last[i] = now
        kind = out.finish_reason.type
        if kind != common_pb2.FINISH_NONE and i not in self._finished:
            self._finished.add(i)
            if kind in _FINISHED:
                m.success.labels(label, _FINISHED[kind]).inc()
            else:
                m.aborted.labels(label).inc()
            if len(self._finished) == self._n:
                m.e2e.labels(label).observe(now - self._started)

    def close(self) -> None:
        """The call ended: every choice that did not finish counts as aborted."""
        if self._closed:
            return
        self._closed = True
        unfinished = self._n - len(self._finished)
        if unfinished > 0:
            self._m.aborted.labels(self._label).inc(unfinished)
        self._m.running.labels(self._label).dec()
