"""``bench compare``'s table, prompt sizing and peak-RSS reading, without servers."""

from __future__ import annotations

import argparse
import os

from ringserve.bench.compare import format_table, prompts_for, vm_hwm_mib


def _summary(tok_s: float, itl_ms: float) -> dict:
    return {"completed": 8, "failed": 0, "output_throughput": tok_s, "median_ttft_ms": 100.0,
            "median_itl_ms": itl_ms, "median_tpot_ms": itl_ms, "median_e2e_latency_ms": 1000.0}


def test_table_has_ringserve_ratios_per_baseline():
    results = {
        "transformers": {1: _summary(20.0, 50.0), 8: _summary(20.0, 50.0)},
        "llama-server": {1: _summary(50.0, 20.0), 8: _summary(100.0, 80.0)},
        "ringserve": {1: _summary(40.0, 25.0), 8: _summary(250.0, 30.0)},
    }
    lines = format_table(results, [1, 8]).splitlines()
    assert lines[0].endswith("| rs/transformers tok/s | rs/llama-server tok/s |")
    assert lines[4] == "| 1 | ringserve | 8/0 | 40.0 | 100 | 25.0 | 25.0 | 1000 | 2.00x | 0.80x |"
    assert lines[7] == "| 8 | ringserve | 8/0 | 250.0 | 100 | 30.0 | 30.0 | 1000 | 12.50x | 2.50x |"
    assert lines[2].endswith("| 1000 |  |  |")  # baselines carry no ratio


def test_prompts_per_level_and_baseline_cap():
    args = argparse.Namespace(min_prompts=4, waves=2, baseline_max_prompts=8)
    assert [prompts_for(args, "ringserve", c) for c in (1, 8, 64)] == [4, 16, 128]
    assert [prompts_for(args, "transformers", c) for c in (1, 8, 64)] == [4, 8, 8]


def test_peak_rss_of_this_process():
    assert 10 < vm_hwm_mib(os.getpid()) < 64 * 1024
