"""The benchmark's metric definitions on synthetic timestamps: exact values."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest

from ringserve.bench.dataset import arrival_offsets, random_requests, sample_lengths
from ringserve.bench.metrics import (
    RequestResult,
    inter_token_latencies,
    percentile,
    summarize,
    time_per_output_token,
)


def test_percentile_matches_linear_interpolation():
    xs = [15.0, 20.0, 35.0, 40.0, 50.0]
    assert percentile(xs, 0) == 15.0
    assert percentile(xs, 50) == 35.0
    assert percentile(xs, 100) == 50.0
    assert percentile(xs, 40) == 29.0  # pos 1.6: 20 + 0.6 * 15
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5  # unsorted input, even count
    assert percentile(list(map(float, range(1, 101))), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_itl_and_tpot_from_timestamps():
    assert inter_token_latencies([1.0, 1.25, 1.75, 2.0]) == [0.25, 0.5, 0.25]
    assert inter_token_latencies([1.0]) == []
    # 5 tokens, first at 0.5 s, stream over at 1.5 s: 4 gaps share 1.0 s.
    assert time_per_output_token(1.5, 0.5, 5) == 0.25
    assert math.isnan(time_per_output_token(1.5, 0.5, 1))


def _result(start, chunks, end, tokens, prompt_len=10, success=True):
    return RequestResult(success=success, prompt_len=prompt_len, output_tokens=tokens,
                         start_time=start, end_time=end, chunk_times=chunks, error="" if success else "x")


def test_request_result_properties():
    r = _result(10.0, [10.5, 10.75, 11.0], 11.0, 3)
    assert r.ttft == 0.5
    assert r.itl == [0.25, 0.25]
    assert r.e2e_latency == 1.0
    assert r.tpot == 0.25


def test_summarize_exact_figures():
    results = [
        _result(0.0, [0.1, 0.2, 0.3, 0.4], 0.4, 4, prompt_len=8),  # ttft 100, itl 100x3, e2e 400, tpot 100
        _result(0.0, [0.3, 0.5], 0.5, 2, prompt_len=12),  # ttft 300, itl 200, e2e 500, tpot 200
        _result(0.0, [], 0.2, 0, prompt_len=99, success=False),
    ]
    s = summarize(results, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (20, 6)
    assert s["request_throughput"] == 1.0
    assert s["input_throughput"] == 10.0
    assert s["output_throughput"] == 3.0
    assert s["total_token_throughput"] == 13.0
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p99_ttft_ms"] == pytest.approx(298.0)
    assert s["mean_itl_ms"] == pytest.approx(125.0)
    assert s["median_itl_ms"] == pytest.approx(100.0)
    assert s["mean_tpot_ms"] == pytest.approx(150.0)
    assert s["median_e2e_latency_ms"] == pytest.approx(450.0)
    assert s["p99_e2e_latency_ms"] == pytest.approx(499.0)


def test_poisson_arrivals_are_seeded_and_have_the_rate():
    a = arrival_offsets(2000, request_rate=4.0, seed=7)
    assert a == arrival_offsets(2000, request_rate=4.0, seed=7)
    assert a != arrival_offsets(2000, request_rate=4.0, seed=8)
    assert a[0] == 0.0 and all(x < y for x, y in pairwise(a))
    assert 2000 / a[-1] == pytest.approx(4.0, rel=0.1)  # mean gap 1/rate
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


def test_random_dataset_lengths_and_determinism():
    reqs = random_requests(16, input_len=32, output_len=8, vocab_size=100, seed=3, exclude_ids=frozenset(range(10)))
    assert [r.prompt_len for r in reqs] == [32] * 16
    assert [r.output_len for r in reqs] == [8] * 16
    assert all(10 <= i < 100 for r in reqs for i in r.prompt_ids)
    assert reqs == random_requests(16, 32, 8, 100, seed=3, exclude_ids=frozenset(range(10)))
    import random

    lens = sample_lengths(random.Random(0), 500, 40, 0.5)
    assert min(lens) == 20 and max(lens) == 40
