"""Memory: the KV pool is sized by tokens, by GiB, or by default from the memory
available after the weights load, and a request that cannot fit is refused up front."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from services.scheduler.main import parse_args
from services.scheduler.policy import kv_pool
from services.scheduler.policy.kv_pool import GIB, available_memory_bytes, kv_bytes_per_token, kv_pool_tokens

SMOLLM2_BF16 = 2 * 30 * 3 * 64 * 2  # K and V x 30 layers x 3 KV heads x head_dim 64 x 2 bytes


def test_bytes_per_token_of_smollm2():
    assert kv_bytes_per_token(30, 3, 64, torch.bfloat16) == SMOLLM2_BF16 == 23040
    assert kv_bytes_per_token(30, 3, 64, torch.float32) == 2 * SMOLLM2_BF16


def test_the_first_setting_given_sizes_the_pool():
    assert kv_pool_tokens(SMOLLM2_BF16, 100, 1.0, 0, "") == 100
    assert kv_pool_tokens(SMOLLM2_BF16, None, 0.5, 0, "") == (GIB // 2) // SMOLLM2_BF16 == 23301
    assert kv_pool_tokens(SMOLLM2_BF16, None, None, 2 * GIB, "a quarter of 8 GiB") == (2 * GIB) // SMOLLM2_BF16 == 93206
    with pytest.raises(ValueError,
                       match=r"^the KV pool would hold 0 tokens \(--kv-cache-gib 1e-06, 23040 bytes per token\)$"):
        kv_pool_tokens(SMOLLM2_BF16, None, 1e-6, 0, "")


def test_available_memory_is_capped_by_the_cgroup_limit(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(kv_pool.psutil, "virtual_memory", lambda: SimpleNamespace(available=4 * GIB))
    assert available_memory_bytes(tmp_path) == 4 * GIB  # no cgroup files: the host figure
    (tmp_path / "memory.max").write_text("1000000000\n")
    (tmp_path / "memory.current").write_text("400000000\n")
    assert available_memory_bytes(tmp_path) == 600_000_000
    (tmp_path / "memory.max").write_text("max\n")
    assert available_memory_bytes(tmp_path) == 4 * GIB


def test_flags_give_one_size_or_the_fraction(capsys):
    cfg = parse_args(["--model", "m"]).engine
    assert (cfg.max_total_tokens, cfg.kv_cache_gib, cfg.kv_cache_mem_fraction) == (None, None, 0.3)
    assert parse_args(["--model", "m", "--kv-cache-gib", "2"]).engine.kv_cache_gib == 2.0
    for bad, message in ((["--max-total-tokens", "10", "--kv-cache-gib", "1"], "not allowed with argument"),
                         (["--kv-cache-mem-fraction", "1.5"], "--kv-cache-mem-fraction must be in (0, 1)"),
                         (["--kv-cache-gib", "0"], "--kv-cache-gib must be > 0")):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(["--model", "m", *bad])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_engine_sized_in_gib_never_holds_more(make_engine, chat_ids, greedy_req, run_all):
    engine = make_engine(max_total_tokens=None, kv_cache_gib=0.01)  # fp32 weights: 46080 bytes per token
    size = int(0.01 * GIB) // 46080
    assert engine.max_total_tokens == engine.kv_pool.size == engine.load().kv_total_tokens == size == 233
    # A long prompt and a short output (prefill is cheap, decode steps are not) that fill the pool exactly.
    prompt = chat_ids("Summarize: " + "the lamp was lit at dusk. " * 26)
    assert size - len(prompt) == 37
    engine.add_request(greedy_req("fits", prompt, size - len(prompt), ignore_eos=True))
    engine.add_request(greedy_req("too-big", prompt, size - len(prompt) + 1, ignore_eos=True))
    results = run_all(engine)
    assert results["fits"].completion_tokens == size - len(prompt)
    refused = results["too-big"].finish
    assert refused.message == (f"prompt + max_new_tokens = {size + 1} exceeds the KV pool ({size} tokens, "
                               "--max-total-tokens / --kv-cache-gib)")
    assert engine.load().kv_used_tokens == 0
