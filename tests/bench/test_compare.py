"""``bench compare``'s table, prompt sizing and peak-RSS reading, without servers."""

from __future__ import annotations

import argparse
import os

import pytest

from ringserve.bench.compare import (
    build_servers,
    engine_alone_ms,
    format_table,
    gguf_format,
    prompts_for,
    ringserve_quantization,
    vm_hwm_mib,
    weight_formats,
)
from ringserve.bench.floor import BYTES_PER_ELEMENT, itl_ratios


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


def test_every_ringserve_gets_ratios_against_each_llama_format():
    results = {
        "llama-server-Q4_1": {1: _summary(40.0, 25.0)},
        "llama-server-Q8_0": {1: _summary(50.0, 20.0)},
        "ringserve-int8": {1: _summary(75.0, 13.0)},
        "ringserve": {1: _summary(30.0, 33.0)},
    }
    lines = format_table(results, [1]).splitlines()
    assert lines[0].endswith("| rs/llama-server-Q4_1 tok/s | rs/llama-server-Q8_0 tok/s | rs/ringserve-int8 tok/s |")
    assert lines[4].endswith("| 75.0 | 100 | 13.0 | 13.0 | 1000 | 1.88x | 1.50x |  |")  # the variant: baselines only
    assert lines[5].endswith("| 30.0 | 100 | 33.0 | 33.0 | 1000 | 0.75x | 0.60x | 0.40x |")
    assert gguf_format("/c/SmolLM2-135M-Instruct.Q8_0.gguf") == "Q8_0"


def test_int8_and_gguf_floors():
    assert BYTES_PER_ELEMENT["int8"] * 2 == BYTES_PER_ELEMENT["bfloat16"]
    assert (BYTES_PER_ELEMENT["Q8_0"], BYTES_PER_ELEMENT["Q4_1"]) == (1.0625, 0.625)


def test_prompts_per_level_and_baseline_cap():
    args = argparse.Namespace(min_prompts=4, waves=2, baseline_max_prompts=8)
    assert [prompts_for(args, "ringserve", c) for c in (1, 8, 64)] == [4, 16, 128]
    assert [prompts_for(args, "transformers", c) for c in (1, 8, 64)] == [4, 8, 8]


def test_peak_rss_of_this_process():
    assert 10 < vm_hwm_mib(os.getpid()) < 64 * 1024


def test_ringserve_variants_run_beside_the_default():
    args = argparse.Namespace(model="/m", dtype="bfloat16", device="cpu", skip_hf=True, llama_server_bin=None,
                              ringserve_arg=["--max-running-requests", "64"],
                              ringserve_variant=["nondeterministic:--disable-deterministic-inference"])
    servers = build_servers(args)
    assert [s.name for s in servers] == ["ringserve-nondeterministic", "ringserve"]
    variant, default = (s.cmd for s in servers)
    assert variant[-3:] == ["--max-running-requests", "64", "--disable-deterministic-inference"]
    without_port = lambda s, cmd: [a for a in cmd if a not in (str(s.port), str(s.metrics_port))]  # noqa: E731
    assert without_port(servers[0], variant[:-1]) == without_port(servers[1], default)
    args.ringserve_variant = ["no-flags"]
    with pytest.raises(SystemExit, match="expected NAME:FLAGS"):
        build_servers(args)


def test_served_itl_over_the_floor_and_the_engine_alone(tmp_path):
    args = argparse.Namespace(ringserve_arg=["--max-running-requests", "64"],
                              ringserve_variant=["int8:--quantization int8", "wo:--quantization int8wo --seed 1",
                                                 "det:--disable-deterministic-inference"])
    quant = ringserve_quantization(args)
    assert quant == {"ringserve-int8": "int8", "ringserve-wo": "int8wo", "ringserve-det": "none", "ringserve": "none"}
    path = tmp_path / "engine.json"  # what bench/cpu_pool.py --json writes
    path.write_text('{"step_ms": {"none 1 pool": 20.0, "int8 1 pool": 10.0, "int8 64 pool": 70.0}}')
    engine = engine_alone_ms(path, quant)
    assert engine == {"ringserve-int8": 10.0, "ringserve-det": 20.0, "ringserve": 20.0}
    line = itl_ratios({"ringserve-int8": 15.0, "ringserve-wo": 30.0}, {"ringserve-int8": 5.0, "ringserve-wo": 5.0},
                      engine)
    assert line == ("served median ITL at concurrency 1: ringserve-int8 3.0x the floor, 1.50x the engine alone "
                    "(10.0 ms); ringserve-wo 6.0x the floor")


def test_the_floors_cover_a_default_ringserve_quantized_through_its_own_flags():
    """``--ringserve-arg --quantization --ringserve-arg int8`` quantizes the default server: its
    int8 floor is in the table (it was left out, and the table's ITL ratios raised KeyError)."""
    args = argparse.Namespace(dtype="bfloat16", ringserve_arg=["--quantization", "int8"], ringserve_variant=[],
                              llama_gguf=["/g/SmolLM2-135M-Instruct.Q8_0.gguf"])
    assert weight_formats(args) == ["bfloat16", "int8", "Q8_0"]
    args.ringserve_arg = []
    assert weight_formats(args) == ["bfloat16", "Q8_0"]
