"""Prefill/decode disaggregation against co-located replicas, on one machine.

    .venv/bin/python bench/disagg.py [--model DIR] [--long-len 2048] [--long 8] [--short 48] [--concurrency 16]

Launches one ring with ``--replicas 2`` (each scheduler prefills and decodes) and one with
``--prefill-replicas 1 --decode-replicas 1``, and sends each the same mix at the same
concurrency: ``--long`` requests with prompts of ``--long-len`` tokens and ``--short`` requests
of ``--short-len`` tokens, interleaved, all streamed, ``--output-len`` tokens each (ignore_eos).
Prints per setup the short requests' TTFT and ITL p50/p99 (what a long prompt beside them
costs them), output throughput, and for the pair the KV moved: GB/s over the transfers' own
time and the transfer's mean share of a request's TTFT. Prompts are random token ids (seeded):
no cache hits. Both rings share the machine's cores with everything else on it; report the
machine and its load with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ringserve.models import DEFAULT_CACHE
from ringserve.ports import free_ports

SETUPS = {"colocated": ["--replicas", "2"], "pd": ["--prefill-replicas", "1", "--decode-replicas", "1"]}


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def _one(client: httpx.AsyncClient, model: str, ids: list[int], output_len: int) -> tuple[float, list[float]]:
    """One streamed completion -> (TTFT, inter-token gaps), seconds."""
    sent = time.monotonic()
    stamps: list[float] = []
    body = {"model": model, "prompt": ids, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                stamps.append(time.monotonic())
    return stamps[0] - sent, [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


async def _mix(base: str, model: str, reqs: list[tuple[str, list[int]]], concurrency: int,
               output_len: int) -> tuple[dict[str, list], float]:
    sem = asyncio.Semaphore(concurrency)
    out: dict[str, list] = {"long": [], "short": []}

    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        async def run(kind: str, ids: list[int]) -> None:
            async with sem:
                out[kind].append(await _one(client, model, ids, output_len))

        started = time.monotonic()
        await asyncio.gather(*(run(kind, ids) for kind, ids in reqs))
    return out, time.monotonic() - started


def _scrape(url: str) -> dict[str, float]:
    text = httpx.get(url, timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _launch(model: Path, flags: list[str], kv_tokens: int) -> tuple[subprocess.Popen, str, str]:
    http, metrics = free_ports(2)
    proc = subprocess.Popen([sys.executable, "-m", "ringserve.cli", "launch", "--model", str(model), "--port",
                             str(http), "--tokenizer-port", "0", "--scheduler-metrics-port", str(metrics),
                             "--max-total-tokens", str(kv_tokens), *flags],
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{http}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"ringserve launch {' '.join(flags)} exited with {proc.returncode}"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base, f"http://127.0.0.1:{metrics}/metrics"
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the ring did not come up in 600 s")


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_CACHE / "models" / "SmolLM2-135M-Instruct")
    p.add_argument("--long-len", type=int, default=2048)
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument("--long", type=int, default=8)
    p.add_argument("--short", type=int, default=48)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rng = random.Random(0)
    kinds = ["long"] * args.long + ["short"] * args.short
    rng.shuffle(kinds)
    reqs = [(k, [rng.randrange(100, 40000) for _ in range(args.long_len if k == "long" else args.short_len)])
            for k in kinds]
    kv_tokens = args.concurrency * (args.long_len + args.output_len) + 1024
    report: dict[str, dict] = {}
    for name, flags in SETUPS.items():
        proc, base, metrics_url = _launch(args.model, flags, kv_tokens)
        try:
            model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
            out, wall = asyncio.run(_mix(base, model, reqs, args.concurrency, args.output_len))
            metrics = _scrape(metrics_url)  # the first scheduler's: the prefill one in "pd"
        finally:
            _stop(proc)
        ttft = [t for t, _ in out["short"]]
        itl = [g for _, gaps in out["short"] for g in gaps]
        all_ttft = [t for kind in out.values() for t, _ in kind]
        row = {"short_ttft_p50_s": _pct(ttft, 50), "short_ttft_p99_s": _pct(ttft, 99),
               "short_itl_p50_s": _pct(itl, 50), "short_itl_p99_s": _pct(itl, 99),
               "output_tok_s": len(reqs) * args.output_len / wall, "wall_s": wall}
        moved, seconds = metrics.get("ringserve:kv_transfer_bytes_total", 0.0), \
            metrics.get("ringserve:kv_transfer_seconds_total", 0.0)
        if name == "pd" and seconds:
            row["kv_transfer_gb_s"] = moved / seconds / 1e9
            row["kv_transfer_share_of_ttft"] = (seconds / len(reqs)) / statistics.mean(all_ttft)
            row["kv_transfer_bytes"] = moved
        report[name] = row
        print(name, " ".join(f"{k}={v:.4g}" for k, v in row.items()), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": report},
                                        indent=1))


if __name__ == "__main__":
    main()
