"""CPU time each ringserve process spends per output token while a launched ring streams.

Launches ``ringserve launch`` from this checkout on free ports, warms it up with two short
requests, then for each concurrency runs ``ringserve bench serve`` (random-ids prompts,
streamed, ``ignore_eos``) and reads every service's CPU time (utime + stime of
``/proc/<pid>/stat``, all threads) before and after, and the load generator's own
(``wait4`` rusage). Prints one JSON line per concurrency: CPU ms per output token per
process, the three front services together, and the run's median ITL / output tok/s.

CPU time, unlike wall time, barely moves when other work shares the cores, so it is the
figure to compare between two checkouts run back to back. Compare the median ITL with
``python bench/engine.py --dtype bfloat16 --batch 1 --threads 2`` (the engine
alone) run in the same sitting, under the same ``OMP_WAIT_POLICY``.

Usage (from the repo root)::

    .venv/bin/python bench/front_cpu.py [--concurrency 1 16] [--num-prompts 3] \
        [--input-len 128] [--output-len 128] [--launch-args "--dtype bfloat16"]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from ringserve.launch import service_processes
from ringserve.models import DEFAULT_CACHE, SMOLLM2_DIR
from ringserve.ports import free_ports

SERVICES = ("gateway", "tokenizer", "scheduler", "detokenizer")
FRONT = ("gateway", "tokenizer", "detokenizer")
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of process ``pid``, all its threads (seconds)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def run_bench(base_url: str, model: Path, concurrency: int, n: int, input_len: int,
              output_len: int) -> tuple[float, dict]:
    """(load generator CPU seconds, ``bench serve``'s JSON summary) of one run."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "ringserve.cli", "bench", "serve", "--base-url", base_url,
               "--input-len", str(input_len), "--output-len", str(output_len), "--num-prompts", str(n),
               "--max-concurrency", str(concurrency), "--disable-progress", "--tokenizer", str(model),
               "--json", out.name]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        text = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        if status != 0:
            raise RuntimeError(f"bench serve failed:\n{text.decode(errors='replace')}")
        return usage.ru_utime + usage.ru_stime, json.loads(Path(out.name).read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_CACHE / "models" / SMOLLM2_DIR)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1])
    p.add_argument("--num-prompts", type=int, default=3, help="per concurrency (at least the concurrency)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--launch-args", default="", help="more flags for ringserve launch")
    a = p.parse_args(argv)
    port, tok_port = free_ports(2)
    base_url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "ringserve.cli", "launch", "--model", str(a.model), "--port", str(port),
           "--tokenizer-port", str(tok_port), *shlex.split(a.launch_args)]
    log = tempfile.NamedTemporaryFile("wb", prefix="front-cpu-launch-", suffix=".log", delete=False)
    launcher = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            if launcher.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the ring did not start; see {log.name}")
            try:
                with urllib.request.urlopen(base_url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        pids = {name: pid for name in SERVICES for pid, _ in service_processes(launcher.pid, name)[:1]}
        run_bench(base_url, a.model, 1, 2, a.input_len, 16)  # warm-up
        for c in a.concurrency:
            n = max(a.num_prompts, c)
            before = {name: cpu_s(pid) for name, pid in pids.items()}
            client_s, summary = run_bench(base_url, a.model, c, n, a.input_len, a.output_len)
            after = {name: cpu_s(pid) for name, pid in pids.items()}
            tokens = summary["total_output_tokens"]
            per_token = {name: round(1e3 * (after[name] - before[name]) / tokens, 3) for name in pids}
            per_token["load_generator"] = round(1e3 * client_s / tokens, 3)
            print(json.dumps({
                "concurrency": c, "output_tokens": tokens, "cpu_ms_per_output_token": per_token,
                "front_services_ms": round(sum(per_token[s] for s in FRONT), 3),
                "median_itl_ms": summary["median_itl_ms"], "output_tok_s": summary["output_throughput"],
                "load_avg_1min": os.getloadavg()[0],
            }), flush=True)
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
