"""The transformers baseline server streams one completion with the exact token count."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from ringserve.bench.client import send_request
from ringserve.bench.serve import ServeConfig, run_benchmark
from ringserve.launch import free_port

HF_SERVER = Path(__file__).resolve().parents[2] / "bench" / "baselines" / "hf_server.py"


@pytest.mark.ring  # starts the transformers baseline server
def test_hf_server_streams_exact_token_count(smollm2_dir):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(HF_SERVER), "--model", str(smollm2_dir), "--port", str(port), "--dtype", "float32"],
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "hf_server exited"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "hf_server not up in 120 s"
            time.sleep(0.3)
        assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == smollm2_dir.name
        body = {"model": smollm2_dir.name, "prompt": [1, 504, 3458, 314], "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

        async def one():
            async with httpx.AsyncClient(timeout=60) as client:
                streamed = await send_request(client, base, "completions", body, prompt_len=4)
                whole = (await client.post(base + "/v1/completions", json={**body, "stream": False})).json()
                return streamed, whole

        streamed, whole = asyncio.run(one())
        assert streamed.success, streamed.error
        assert (streamed.prompt_len, streamed.output_tokens) == (4, 12)
        assert whole["usage"]["completion_tokens"] == 12
        assert whole["choices"][0]["finish_reason"] == "length"
        assert streamed.generated_text == whole["choices"][0]["text"]  # greedy: same text either way

        # No /v1/detokenize or /get_model_info here: text prompts come from the local tokenizer.
        cfg = ServeConfig(base_url=base, prompt_format="text", tokenizer=str(smollm2_dir), num_prompts=2,
                          input_len=8, output_len=4, max_concurrency=2, warmup_requests=0, progress=False)
        summary, results = asyncio.run(run_benchmark(cfg))
        assert (summary["completed"], summary["total_output_tokens"]) == (2, 8), [r.error for r in results]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
