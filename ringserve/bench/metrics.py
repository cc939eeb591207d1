"""Per-request measurements and their summary, as SGLang bench_serving and vLLM bench serve
define them. Pure Python: no network, no numpy, so every figure is unit-testable.

Definitions (times in seconds inside, milliseconds in the summary):

- TTFT: request sent → first content chunk received.
- ITL: gaps between successive content chunks of one request (a chunk that carries several
  tokens is still one gap, as in vLLM and SGLang).
- TPOT: ``(e2e - ttft) / (output_tokens - 1)``; undefined for one-token outputs.
- E2E latency: request sent → last byte of the stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import pairwise

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e_latency")
SUMMARY_STATS = ("mean", "median", "p99")


@dataclass
class RequestResult:
    """What one streamed request produced.

    ``chunk_times`` are ``time.perf_counter()`` readings (s) of each content chunk, in
    arrival order; ``start_time`` is the reading when the request was sent.
    ``output_tokens`` comes from the usage chunk when the server sends one, else it is the
    number of content chunks.
    """

    success: bool
    prompt_len: int = 0
    output_tokens: int = 0
    start_time: float = 0.0
    end_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""

    @property
    def ttft(self) -> float:
        """Seconds from send to the first content chunk; ``nan`` if none came."""
        return self.chunk_times[0] - self.start_time if self.chunk_times else math.nan

    @property
    def e2e_latency(self) -> float:
        """Seconds from send to the end of the stream."""
        return self.end_time - self.start_time

    @property
    def itl(self) -> list[float]:
        """Seconds between successive content chunks; ``len(chunk_times) - 1`` values."""
        return inter_token_latencies(self.chunk_times)

    @property
    def tpot(self) -> float:
        """Seconds per output token after the first; ``nan`` when fewer than two tokens."""
        return time_per_output_token(self.e2e_latency, self.ttft, self.output_tokens)


def inter_token_latencies(chunk_times: list[float]) -> list[float]:
    """Gaps (s) between successive chunk arrival times (s); ``n - 1`` values for ``n`` chunks."""
    return [b - a for a, b in pairwise(chunk_times)]


def time_per_output_token(e2e_s: float, ttft_s: float, output_tokens: int) -> float:
    """``(e2e - ttft) / (output_tokens - 1)`` in seconds, ``nan`` when ``output_tokens < 2``."""
    if output_tokens < 2:
        return math.nan
    return (e2e_s - ttft_s) / (output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks.

    Matches ``numpy.percentile(values, q)`` (method "linear"), which vLLM and SGLang use.
    Returns ``nan`` for an empty list.

    Raises:
        ValueError: ``q`` is outside [0, 100].
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: list[float]) -> float:
    """Arithmetic mean; ``nan`` for an empty list."""
    return sum(values) / len(values) if values else math.nan


def summarize(
    results: list[RequestResult], duration_s: float, percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
) -> dict:
    """Aggregate figures of one benchmark run.

    Args:
        results: one entry per request, failed ones included.
        duration_s: wall time (s) from the first send to the last completion.
        percentiles: extra percentiles kept per latency metric (``p90_ttft_ms`` ...).

    Returns:
        A flat dict: ``completed``, ``failed``, ``duration_s``, ``total_input_tokens``,
        ``total_output_tokens``, ``request_throughput`` (req/s), ``input_throughput``,
        ``output_throughput`` and ``total_token_throughput`` (tok/s), and for each of
        ttft, tpot, itl, e2e_latency: ``mean_*_ms``, ``median_*_ms``, ``p99_*_ms`` and
        ``p<q>_*_ms`` for each requested percentile. Latencies of failed requests are
        left out, as in vLLM; a metric with no samples is ``nan``.
    """
    ok = [r for r in results if r.success]
    samples = {
        "ttft": [r.ttft for r in ok if r.chunk_times],
        "tpot": [r.tpot for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2e_latency": [r.e2e_latency for r in ok],
    }
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    out: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(total_in),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
    }
    for name in LATENCY_METRICS:
        ms = [v * 1000 for v in samples[name]]
        out[f"mean_{name}_ms"] = mean(ms)
        out[f"median_{name}_ms"] = percentile(ms, 50)
        for q in sorted({99.0, *percentiles}):
            out[f"p{q:g}_{name}_ms"] = percentile(ms, q)
    return out
