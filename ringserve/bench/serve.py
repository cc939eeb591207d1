"""``ringserve bench serve``: load an OpenAI-compatible server and report TTFT, ITL, TPOT,
E2E latency and throughput.

Follows SGLang's ``bench_serving.py`` and vLLM's ``vllm bench serve``: requests arrive by a
Poisson process (``--request-rate``, inf = all at once) and at most ``--max-concurrency``
are in flight; each is greedy, streamed, ``ignore_eos`` with ``max_tokens = output_len``.
One untimed warm-up request runs first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass

import httpx

from ringserve.bench.client import request_body, send_request
from ringserve.bench.dataset import BenchRequest, arrival_offsets, local_tokenizer_info, random_requests
from ringserve.bench.metrics import LATENCY_METRICS, RequestResult, summarize

HTTP_TIMEOUT_S = 6 * 3600.0


@dataclass(frozen=True)
class ServeConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None  # None: the first entry of GET /v1/models
    endpoint: str = "completions"  # completions | chat
    prompt_format: str = "ids"  # ids (completions only) | text
    tokenizer: str | None = None  # a directory with tokenizer.json
    vocab_size: int | None = None
    input_len: int = 128
    output_len: int = 128
    num_prompts: int = 64
    range_ratio: float = 1.0
    seed: int = 0
    max_concurrency: int | None = None  # None: unbounded
    request_rate: float = math.inf  # req/s
    warmup_requests: int = 1
    progress: bool = True
    json_path: str | None = None
    plot_path: str | None = None

    @property
    def effective_prompt_format(self) -> str:
        return "text" if self.endpoint == "chat" else self.prompt_format


async def resolve_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The id of the first model in ``GET /v1/models``."""
    resp = await client.get(base_url + "/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def _vocab(client: httpx.AsyncClient, cfg: ServeConfig) -> tuple[int, frozenset[int]]:
    if cfg.tokenizer:
        _, vocab, specials = local_tokenizer_info(cfg.tokenizer)
        return cfg.vocab_size or vocab, specials
    if cfg.vocab_size:
        return cfg.vocab_size, frozenset()
    resp = await client.get(cfg.base_url + "/get_model_info")  # ringserve and SGLang
    if resp.status_code == 200 and resp.json().get("vocab_size"):
        info = resp.json()
        return int(info["vocab_size"]), frozenset(info.get("eos_token_ids") or ())
    raise SystemExit("bench serve: the server has no /get_model_info; give --tokenizer DIR or --vocab-size N")


async def _decode(client: httpx.AsyncClient, cfg: ServeConfig, model: str, ids: tuple[int, ...]) -> str:
    if cfg.tokenizer:
        tok, _, _ = local_tokenizer_info(cfg.tokenizer)
        return tok.decode(list(ids), skip_special_tokens=False)
    resp = await client.post(cfg.base_url + "/v1/detokenize", json={"model": model, "tokens": list(ids)})
    if resp.status_code != 200:
        raise SystemExit("bench serve: the server has no /v1/detokenize; give --tokenizer DIR for text prompts")
    return resp.json()["prompt"]


async def build_requests(client: httpx.AsyncClient, cfg: ServeConfig, model: str) -> list[BenchRequest]:
    """The random-ids dataset of ``cfg``, with decoded text when the prompt format needs it."""
    vocab, exclude = await _vocab(client, cfg)
    reqs = random_requests(
        cfg.num_prompts, cfg.input_len, cfg.output_len, vocab, cfg.range_ratio, cfg.seed, exclude
    )
    if cfg.effective_prompt_format == "text":
        texts = [await _decode(client, cfg, model, r.prompt_ids) for r in reqs]
        reqs = [BenchRequest(r.prompt_ids, r.output_len, t) for r, t in zip(reqs, texts, strict=True)]
    return reqs


async def run_benchmark(
    cfg: ServeConfig, requests: list[BenchRequest] | None = None
) -> tuple[dict, list[RequestResult]]:
    """Run ``requests`` (default: ``cfg``'s random dataset) against ``cfg.base_url``.

    Returns the ``summarize`` figures (plus the run's settings) and the per-request results.
    """
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, limits=limits, trust_env=False) as client:
        model = cfg.model or await resolve_model(client, cfg.base_url)
        if requests is None:
            requests = await build_requests(client, cfg, model)
        fmt = cfg.effective_prompt_format
        for req in requests[: cfg.warmup_requests]:
            warm = BenchRequest(req.prompt_ids, min(req.output_len, 4), req.prompt_text)
            body = request_body(cfg.endpoint, model, warm, fmt)
            res = await send_request(client, cfg.base_url, cfg.endpoint, body, req.prompt_len)
            if not res.success:
                raise SystemExit(f"bench serve: warm-up request failed: {res.error}")

        bar = _progress(len(requests), cfg.progress)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.seed)
        start = time.perf_counter()

        async def one(req: BenchRequest, at_s: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
            body = request_body(cfg.endpoint, model, req, fmt)
            if sem is None:
                res = await send_request(client, cfg.base_url, cfg.endpoint, body, req.prompt_len)
            else:
                async with sem:
                    res = await send_request(client, cfg.base_url, cfg.endpoint, body, req.prompt_len)
            if bar is not None:
                bar.update(1)
            return res

        results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, offsets, strict=True)))
        duration = time.perf_counter() - start
        if bar is not None:
            bar.close()
    summary = summarize(list(results), duration)
    settings = {
        "base_url": cfg.base_url, "model": model, "endpoint": cfg.endpoint, "prompt_format": fmt,
        "num_prompts": len(requests), "input_len": cfg.input_len, "output_len": cfg.output_len,
        "range_ratio": cfg.range_ratio, "seed": cfg.seed, "max_concurrency": cfg.max_concurrency,
        "request_rate": cfg.request_rate,
    }
    return {**settings, **summary}, list(results)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", file=sys.stderr, dynamic_ncols=True)


def format_report(summary: dict) -> str:
    """A vLLM-style text report of ``summary`` (figures in ms, tok/s, req/s)."""
    rows = [
        ("Successful requests", f"{summary['completed']}"),
        ("Failed requests", f"{summary['failed']}"),
        ("Max concurrency", f"{summary['max_concurrency']}"),
        ("Request rate (req/s)", f"{summary['request_rate']}"),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", f"{summary['total_input_tokens']}"),
        ("Total output tokens", f"{summary['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{summary['input_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
    ]
    for name in LATENCY_METRICS:
        for stat in ("mean", "median", "p99"):
            label = f"{stat.capitalize()} {name.upper().replace('_LATENCY', '')} (ms)"
            rows.append((label, f"{summary[f'{stat}_{name}_ms']:.2f}"))
    width = 50
    lines = ["=" * width, " Serving Benchmark Result ".center(width, "="), *(f"{k:<38}{v:>12}" for k, v in rows),
             "=" * width]
    return "\n".join(lines)


def write_json(path: str, summary: dict, results: list[RequestResult]) -> None:
    """``summary`` plus per-request arrays (s): prompt_lens, output_tokens, ttfts, e2e_latencies, itls, errors."""
    per_request = {
        "prompt_lens": [r.prompt_len for r in results],
        "output_tokens": [r.output_tokens for r in results],
        "ttfts": [r.ttft for r in results],
        "e2e_latencies": [r.e2e_latency for r in results],
        "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
    }
    with open(path, "w") as f:
        json.dump({**summary, "per_request": per_request}, f, indent=2)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``bench serve`` whose defaults come from ``ServeConfig``."""
    d = ServeConfig()
    p.add_argument("--base-url", default=d.base_url, help="server root, without /v1")
    p.add_argument("--model", default=d.model, help="default: the first of GET /v1/models")
    p.add_argument("--endpoint", choices=["completions", "chat"], default=d.endpoint)
    p.add_argument("--prompt-format", choices=["ids", "text"], default=d.prompt_format,
                   help="ids: prompt as a list of token ids (completions only; chat always sends text)")
    p.add_argument("--tokenizer", default=d.tokenizer,
                   help="dir with tokenizer.json (vocab, and text decoding when the server has no /v1/detokenize)")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size,
                   help="ids are drawn from [0, N) (default: --tokenizer's, else the server's /get_model_info)")
    p.add_argument("--input-len", type=int, default=d.input_len,
                   help="prompt tokens (the maximum when --range-ratio < 1)")
    p.add_argument("--output-len", type=int, default=d.output_len, help="max_tokens, with ignore_eos")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts)
    p.add_argument("--range-ratio", type=float, default=d.range_ratio,
                   help="lengths uniform in [len * ratio, len] (SGLang's rule); 1 = fixed")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the prompts and the arrival times")
    p.add_argument("--max-concurrency", type=int, default=d.max_concurrency,
                   help="requests in flight at most (default: no cap)")
    p.add_argument("--request-rate", type=float, default=d.request_rate, help="req/s, Poisson; inf = all at once")
    p.add_argument("--warmup-requests", type=int, default=d.warmup_requests)
    p.add_argument("--disable-progress", action="store_true")


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    return ServeConfig(
        base_url=args.base_url.rstrip("/"), model=args.model, endpoint=args.endpoint,
        prompt_format=args.prompt_format, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
        input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts,
        range_ratio=args.range_ratio, seed=args.seed, max_concurrency=args.max_concurrency,
        request_rate=args.request_rate, warmup_requests=args.warmup_requests,
        progress=not args.disable_progress, json_path=getattr(args, "json", None),
        plot_path=getattr(args, "plot", None),
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="ringserve bench serve",
        description="Load an OpenAI-compatible server (random-ids prompts, streamed, ignore_eos) and "
        "report TTFT, ITL, TPOT, E2E latency (mean, median, p99 in ms) and throughput.",
    )
    add_serve_args(p)
    p.add_argument("--json", default=None, help="write every figure and per-request data here")
    p.add_argument("--plot", default=None, help="write a PNG of latency percentiles and throughput here")
    cfg = config_from_args(p.parse_args(argv))
    if cfg.endpoint == "chat" and cfg.prompt_format == "ids":
        print("bench serve: the chat endpoint takes text; prompts are decoded", file=sys.stderr)
    summary, results = asyncio.run(run_benchmark(cfg))
    print(format_report(summary))
    if cfg.json_path:
        write_json(cfg.json_path, summary, results)
    if cfg.plot_path:
        from ringserve.bench.plot import plot_run

        plot_run(cfg.plot_path, summary, results)
