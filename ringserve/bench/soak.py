"""``ringserve bench soak`` (``make soak``): a bounded soak run of a ring it launches itself.

It starts ``ringserve launch --restart-on-failure`` on free loopback ports, then keeps
``--streams`` chat streams busy for ``--duration`` seconds: random prompts, random
``max_tokens`` (1..``--max-tokens``), a random stop string on half of them, greedy or
sampled; ``--disconnect-rate`` of them are closed by the client after a random number of
chunks. At ``--kill-at`` seconds it SIGKILLs the scheduler once (the launcher starts it
again). A per-request watchdog calls a request hung when no byte arrived for
``--stall-timeout`` seconds.

At the end it prints requests done, outcomes and errors by kind, p50/p99 TTFT and ITL
(inter-chunk latency of content chunks), and each service's accounting gauges read over
gRPC ``GetLoad`` once the last request is over. It exits 1 when a gauge is not back to
its baseline (zero) within ``--settle-timeout`` seconds or a request hung, else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

from ringserve import grpcutil
from ringserve.bench.metrics import inter_token_latencies, percentile
from ringserve.internal_auth import InternalAuth
from ringserve.launch import free_port, service_pid, stop_launched, wait_launched
from ringserve.v1 import common_pb2, detokenizer_pb2_grpc, scheduler_pb2_grpc, tokenizer_pb2_grpc

PROMPTS = (
    "Write a long story about a lighthouse keeper.",
    "Explain how rivers shape valleys.",
    "List the planets of the solar system and describe each one.",
    "What is the capital of France?",
    "Count from 1 to 200, separated by spaces.",
    "Describe your favourite recipe step by step.",
    "Write a poem about the sea.",
    "Give me ten tips for learning a new language.",
)
STOPS = (".", "\n", " the", "\n\n", ",", " and")
# Gauges that must read zero once no request is in flight: (service, LoadReport field).
GAUGES = (
    ("tokenizer", "req_states"),
    ("scheduler", "num_running_reqs"),
    ("scheduler", "num_waiting_reqs"),
    ("scheduler", "req_slots_used"),
    ("scheduler", "kv_used_tokens"),
    ("detokenizer", "decode_states"),
)
STUBS = {
    "tokenizer": tokenizer_pb2_grpc.TokenizerStub,
    "scheduler": scheduler_pb2_grpc.SchedulerStub,
    "detokenizer": detokenizer_pb2_grpc.DetokenizerStub,
}


@dataclass(frozen=True)
class SoakConfig:
    """One soak run. Times are in seconds from the start of the workload."""

    model: Path
    duration_s: float = 300.0
    streams: int = 64
    disconnect_rate: float = 0.2
    max_tokens: int = 256
    kill_at_s: float | None = None  # None: half of duration_s; < 0: no kill
    stall_timeout_s: float = 60.0
    settle_timeout_s: float = 30.0
    seed: int = 0
    dtype: str = "auto"

    @property
    def kill_time_s(self) -> float | None:
        if self.kill_at_s is None:
            return self.duration_s / 2
        return None if self.kill_at_s < 0 else self.kill_at_s


@dataclass
class Tally:
    """What the workers saw; outcomes are "ok", "disconnected" (by the soak's own client),
    "hung" or an error kind such as "HTTP 503 service_unavailable_error"."""

    outcomes: Counter = field(default_factory=Counter)
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)

    @property
    def done(self) -> int:
        return sum(self.outcomes.values())

    def errors(self) -> dict[str, int]:
        return {k: v for k, v in sorted(self.outcomes.items()) if k not in ("ok", "disconnected")}


class Hung(Exception):
    """No byte of a response arrived for the stall timeout."""


def random_body(rng: random.Random, model: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"{rng.choice(PROMPTS)} (request {rng.randrange(10**6)})"}],
        "max_tokens": rng.randint(1, max_tokens),
        "temperature": rng.choice((0.0, 0.8)),
        "stream": True,
    }
    if rng.random() < 0.5:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
    return body


async def _next(it, timeout_s: float):
    try:
        return await asyncio.wait_for(anext(it), timeout_s)
    except TimeoutError:
        raise Hung from None


async def one_request(client: httpx.AsyncClient, body: dict, disconnect_after: int | None,
                      stall_s: float, tally: Tally) -> float:
    """Run one streamed request and record its outcome; returns the Retry-After to honour (s)."""
    start = time.perf_counter()
    chunk_times: list[float] = []
    events = 0
    try:
        request = client.build_request("POST", "/v1/chat/completions", json=body)
        resp = await asyncio.wait_for(client.send(request, stream=True), stall_s)
        try:
            if resp.status_code != 200:
                try:
                    error = orjson.loads(await resp.aread()).get("error", {})
                except orjson.JSONDecodeError:
                    error = {"type": "(not an OpenAI error body)"}
                tally.outcomes[f"HTTP {resp.status_code} {error.get('type')}"] += 1
                return float(resp.headers.get("retry-after", 0))
            lines = resp.aiter_lines()
            while True:
                try:
                    line = await _next(lines, stall_s)
                except StopAsyncIteration:
                    tally.outcomes["stream ended without [DONE]"] += 1
                    return 0.0
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    tally.outcomes["ok"] += 1
                    return 0.0
                chunk = orjson.loads(data)
                if "error" in chunk:
                    tally.outcomes[f"stream error event {chunk['error'].get('type')}"] += 1
                    return 0.0
                delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
                if delta.get("content"):
                    chunk_times.append(time.perf_counter())
                events += 1
                if disconnect_after is not None and events >= disconnect_after:
                    tally.outcomes["disconnected"] += 1
                    return 0.0
        finally:
            await resp.aclose()
            if chunk_times:
                tally.ttfts.append(chunk_times[0] - start)
                tally.itls.extend(inter_token_latencies(chunk_times))
    except (Hung, TimeoutError):
        tally.outcomes["hung"] += 1
    except httpx.HTTPError as exc:
        tally.outcomes[f"transport {type(exc).__name__}"] += 1
        return 1.0
    except ValueError as exc:  # a body that is not JSON
        tally.outcomes[f"bad response {type(exc).__name__}"] += 1
    return 0.0


async def worker(client: httpx.AsyncClient, cfg: SoakConfig, model: str, rng: random.Random,
                 end: float, tally: Tally) -> None:
    while time.monotonic() < end:
        disconnect_after = rng.randint(1, 8) if rng.random() < cfg.disconnect_rate else None
        wait = await one_request(client, random_body(rng, model, cfg.max_tokens), disconnect_after,
                                 cfg.stall_timeout_s, tally)
        if wait:
            await asyncio.sleep(min(wait, max(0.0, end - time.monotonic())))


def read_gauges(addresses: dict[str, str], auth: InternalAuth) -> dict[tuple[str, str], int]:
    """Each service's GetLoad, read directly over gRPC (with the ring's internal credential,
    which the scheduler and detokenizer require); the GAUGES fields."""
    reports = {}
    for name, address in addresses.items():
        with grpcutil.sync_channel(address) as channel:
            reports[name] = STUBS[name](channel).GetLoad(common_pb2.Empty(), timeout=5, metadata=auth.metadata())
    return {(svc, f): getattr(reports[svc], f) for svc, f in GAUGES}


def settle(addresses: dict[str, str], auth: InternalAuth, timeout_s: float) -> dict[tuple[str, str], int]:
    """Gauges once all read zero, or the last reading after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    err: Exception | None
    while True:
        try:
            gauges = read_gauges(addresses, auth)
        except Exception as exc:  # a service still restarting: read again
            gauges = {g: -1 for g in GAUGES}
            err = exc
        else:
            err = None
            if not any(gauges.values()):
                return gauges
        if time.monotonic() > deadline:
            if err is not None:
                print(f"ringserve soak: could not read the gauges: {err}", flush=True)
            return gauges
        time.sleep(0.2)


async def run_workload(cfg: SoakConfig, base_url: str, model: str, kill) -> tuple[Tally, str]:
    """The workers, plus the one scheduler kill; returns the tally and a line about the kill."""
    tally = Tally()
    rng = random.Random(cfg.seed)
    limits = httpx.Limits(max_connections=cfg.streams + 8, max_keepalive_connections=cfg.streams + 8)
    kill_note = "no scheduler kill"
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=None, trust_env=False) as client:
        start = time.monotonic()
        end = start + cfg.duration_s
        workers = [asyncio.create_task(worker(client, cfg, model, random.Random(rng.random()), end, tally))
                   for _ in range(cfg.streams)]
        if cfg.kill_time_s is not None and cfg.kill_time_s < cfg.duration_s:
            await asyncio.sleep(cfg.kill_time_s)
            pid = kill()
            killed = time.monotonic()
            kill_note = f"scheduler (pid {pid}) killed at {killed - start:.1f} s"
            while time.monotonic() < killed + 5:  # until the tokenizer has noticed the lost link
                try:
                    if (await client.get("/health", timeout=2.0)).status_code != 200:
                        break
                except httpx.HTTPError:
                    break
                await asyncio.sleep(0.05)
            while time.monotonic() < end + cfg.stall_timeout_s:
                try:
                    if (await client.get("/health", timeout=2.0)).status_code == 200:
                        kill_note += f", serving again {time.monotonic() - killed:.1f} s later"
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
            else:
                kill_note += ", not serving again before the end"
        await asyncio.gather(*workers)
    return tally, kill_note


def report(cfg: SoakConfig, tally: Tally, kill_note: str, gauges: dict[tuple[str, str], int], took_s: float) -> bool:
    """Print the summary; True when every gauge is at baseline and no request hung."""
    def ms(values: list[float], q: float) -> str:
        return f"{percentile(values, q) * 1000:.1f} ms" if values else "n/a"

    print(f"ringserve soak: {cfg.duration_s:g} s, {cfg.streams} streams, {cfg.disconnect_rate:.0%} disconnects, "
          f"max_tokens 1..{cfg.max_tokens}; {kill_note}; workload ended after {took_s:.1f} s")
    o = tally.outcomes
    print(f"requests done: {tally.done} (completed {o['ok']}, disconnected by the client {o['disconnected']}, "
          f"errors {sum(tally.errors().values()) - o['hung']}, hung {o['hung']})")
    errors = tally.errors()
    print("errors by kind:" + ("" if errors else " none"))
    for kind, count in errors.items():
        print(f"  {kind}: {count}")
    print(f"TTFT p50 {ms(tally.ttfts, 50)}, p99 {ms(tally.ttfts, 99)} ({len(tally.ttfts)} requests)")
    print(f"ITL  p50 {ms(tally.itls, 50)}, p99 {ms(tally.itls, 99)} ({len(tally.itls)} gaps)")
    print("gauges at the end (baseline 0):")
    for service in ("tokenizer", "scheduler", "detokenizer"):
        fields = " ".join(f"{f}={v}" for (svc, f), v in gauges.items() if svc == service)
        print(f"  {service}: {fields}")
    at_baseline = not any(gauges.values())
    ok = at_baseline and o["hung"] == 0
    why = [] if at_baseline else ["gauges not back to baseline"]
    why += [f"{o['hung']} requests hung"] if o["hung"] else []
    print("result: " + ("OK: every gauge back to baseline, no request hung" if ok else "FAILED: " + "; ".join(why)),
          flush=True)
    return ok


def soak(cfg: SoakConfig, log_path: Path) -> bool:
    """Launch the ring, run the workload, print the report; True on success."""
    ports = {name: free_port() for name in ("http", "tokenizer", "scheduler", "detokenizer")}
    addresses = {name: f"127.0.0.1:{ports[name]}" for name in STUBS}
    cmd = [
        sys.executable, "-m", "ringserve.cli", "launch", "--model", str(cfg.model), "--dtype", cfg.dtype,
        "--port", str(ports["http"]), "--tokenizer-port", str(ports["tokenizer"]),
        "--scheduler-port", str(ports["scheduler"]), "--detokenizer-port", str(ports["detokenizer"]),
        "--restart-on-failure",
    ]
    base_url = f"http://127.0.0.1:{ports['http']}"
    auth = InternalAuth.generate()  # the ring's, so that the gauges can be read on its internal ports
    print(f"ringserve soak: launching the ring (log: {log_path})", flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **auth.env()})
        try:
            wait_launched(proc, f"{base_url}/health", 600)
            model = httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]

            def kill() -> int:
                pid = service_pid(proc.pid, "scheduler")
                os.kill(pid, signal.SIGKILL)
                return pid

            t0 = time.monotonic()
            tally, kill_note = asyncio.run(run_workload(cfg, base_url, model, kill))
            took = time.monotonic() - t0
            gauges = settle(addresses, auth, cfg.settle_timeout_s)
            return report(cfg, tally, kill_note, gauges, took)
        finally:
            stop_launched(proc)


def parse_args(argv: list[str] | None) -> tuple[SoakConfig, Path | None]:
    from ringserve.models import DEFAULT_CACHE, SMOLLM2_DIR

    d = SoakConfig(model=Path("."))
    p = argparse.ArgumentParser(prog="ringserve bench soak", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_CACHE / "models" / SMOLLM2_DIR)
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of workload (default %(default)s)")
    p.add_argument("--streams", type=int, default=d.streams, help="concurrent streams (default %(default)s)")
    p.add_argument("--disconnect-rate", type=float, default=d.disconnect_rate,
                   help="share of requests the client closes early (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="max_tokens drawn from 1..this")
    p.add_argument("--kill-at", type=float, default=None,
                   help="seconds into the workload to SIGKILL the scheduler (default: half the duration; < 0: never)")
    p.add_argument("--stall-timeout", type=float, default=d.stall_timeout_s,
                   help="a request with no byte for this many seconds counts as hung (default %(default)s)")
    p.add_argument("--settle-timeout", type=float, default=d.settle_timeout_s,
                   help="seconds the gauges get to return to baseline after the last request")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"])
    p.add_argument("--log", type=Path, default=None, help="the ring's log file (default: a temporary file)")
    a = p.parse_args(argv)
    if a.streams < 1 or a.duration <= 0 or not 0 <= a.disconnect_rate <= 1 or a.max_tokens < 1:
        p.error("need --streams >= 1, --duration > 0, --disconnect-rate in [0, 1], --max-tokens >= 1")
    cfg = SoakConfig(model=a.model, duration_s=a.duration, streams=a.streams, disconnect_rate=a.disconnect_rate,
                     max_tokens=a.max_tokens, kill_at_s=a.kill_at, stall_timeout_s=a.stall_timeout,
                     settle_timeout_s=a.settle_timeout, seed=a.seed, dtype=a.dtype)
    return cfg, a.log


def main(argv: list[str] | None = None) -> None:
    cfg, log_path = parse_args(argv)
    if log_path is None:
        log_path = Path(tempfile.mkdtemp(prefix="ringserve-soak-")) / "ring.log"
    sys.exit(0 if soak(cfg, log_path) else 1)


if __name__ == "__main__":
    main()
