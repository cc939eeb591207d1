"""``ringserve bench serve`` against the real stack: exact counts and a complete JSON."""

from __future__ import annotations

import asyncio
import json

from ringserve.bench import serve
from ringserve.bench.metrics import LATENCY_METRICS


def test_bench_serve_counts_and_json(stack, tmp_path):
    out_json, out_png = tmp_path / "run.json", tmp_path / "run.png"
    serve.main([
        "--base-url", stack.base_url, "--num-prompts", "8", "--input-len", "32", "--output-len", "16",
        "--max-concurrency", "4", "--disable-progress", "--json", str(out_json), "--plot", str(out_png),
    ])
    data = json.loads(out_json.read_text())
    assert (data["completed"], data["failed"]) == (8, 0)
    assert data["total_output_tokens"] == 8 * 16  # ignore_eos + max_tokens
    assert data["total_input_tokens"] == 8 * 32  # ids sent as-is: no re-tokenization
    assert data["model"] == stack.model_name
    keys = {"duration_s", "request_throughput", "input_throughput", "output_throughput", "total_token_throughput"}
    keys |= {f"{s}_{m}_ms" for s in ("mean", "median", "p99") for m in LATENCY_METRICS}
    assert keys <= data.keys()
    assert all(data[k] > 0 for k in keys)
    assert data["per_request"]["output_tokens"] == [16] * 8
    assert [len(itl) for itl in data["per_request"]["itls"]] == [15] * 8  # one chunk per token
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_chat_with_server_detokenize(stack):
    cfg = serve.ServeConfig(base_url=stack.base_url, endpoint="chat", num_prompts=2, input_len=8,
                            output_len=4, max_concurrency=2, warmup_requests=0, progress=False)
    summary, results = asyncio.run(serve.run_benchmark(cfg))
    assert (summary["completed"], summary["failed"]) == (2, 0), [r.error for r in results]
    assert summary["total_output_tokens"] == 8
    assert all(r.prompt_len > 8 for r in results)  # usage counts the chat template too
