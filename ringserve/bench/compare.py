"""``ringserve bench compare`` (``make bench``): ringserve against the baselines, one table.

Servers run one after another on the same machine, each fed the same random-ids prompts
(``--input-len`` tokens, ``--output-len`` output tokens, ignore_eos) at each concurrency of
``--concurrency``: the transformers one-request-at-a-time server
(``bench/baselines/hf_server.py``), ringserve (``ringserve launch``) and its variants
(``--ringserve-variant NAME:FLAGS``, e.g. int8 weights), and llama.cpp's ``llama-server``
once per ``--llama-gguf`` (e.g. Q4_1 and Q8_0) when ``--llama-server-bin`` is given. Prints
medians per server and level, each ringserve's throughput ratio against every baseline (and
the default's against its variants), each process's peak RSS (VmHWM) and the
memory-bandwidth floor of a batch-1 decode step for each weight format; ``--json`` keeps
every figure.

A level runs ``max(--min-prompts, concurrency * --waves)`` prompts; the transformers server
serializes requests, so its throughput does not depend on concurrency and it runs at most
``--baseline-max-prompts`` per level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ringserve.bench.dataset import local_tokenizer_info, random_requests
from ringserve.bench.floor import BYTES_PER_ELEMENT, copy_bandwidth_gbps, decode_floor_ms, itl_ratios
from ringserve.bench.serve import ServeConfig, run_benchmark
from ringserve.bench.workloads import chat_requests, copy_requests
from ringserve.launch import free_port

REPO = Path(__file__).resolve().parents[2]
HF_SERVER = REPO / "bench" / "baselines" / "hf_server.py"
START_TIMEOUT_S = 600.0
RINGSERVE_SERVICES = ("gateway", "tokenizer", "scheduler", "detokenizer")


@dataclass
class Server:
    """A benchmarked server process; ``rss`` maps process name → peak RSS (MiB)."""

    name: str
    cmd: list[str]
    port: int
    proc: subprocess.Popen | None = None
    rss: dict[str, float] = field(default_factory=dict)
    metrics_port: int | None = None  # a ringserve's scheduler /metrics (speculative decoding's counters)
    speculation: dict[str, float] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the process (its output goes to a log file) and wait for ``GET /health`` = 200."""
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONUNBUFFERED": "1"}
        log = tempfile.NamedTemporaryFile("wb", prefix=f"bench-{self.name}-", suffix=".log", delete=False)
        print(f"bench: starting {self.name} (log: {log.name})", file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(self.cmd, start_new_session=True, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}: {' '.join(self.cmd)}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not healthy within {START_TIMEOUT_S:.0f} s")

    def read_peak_rss(self) -> None:
        """VmHWM (MiB) of the server process, or of each ringserve service under the launcher."""
        import psutil

        if self.proc is None:
            raise RuntimeError(f"{self.name} was not started")
        procs = {self.name: psutil.Process(self.proc.pid)}
        if self.name.startswith("ringserve"):
            procs = {}
            for child in psutil.Process(self.proc.pid).children():
                args = child.cmdline()
                name = next((a for a in args if a in RINGSERVE_SERVICES), child.name())
                procs[name] = child
        self.rss = {name: vm_hwm_mib(p.pid) for name, p in procs.items()}

    def read_speculation(self) -> None:
        """A ringserve's speculative-decoding counters from its scheduler's /metrics (none without one)."""
        if self.metrics_port is None:
            return
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith("ringserve:speculative_"):  # name{labels} value
                    name, value = line.split("{")[0], line.rsplit(" ", 1)[1]
                    key = name.removeprefix("ringserve:speculative_").removesuffix("_total")
                    self.speculation[key] = float(value)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def vm_hwm_mib(pid: int) -> float:
    """Peak resident set size (MiB) of ``pid``, from ``/proc/<pid>/status`` VmHWM (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM")


def build_servers(args: argparse.Namespace) -> list[Server]:
    py, model = sys.executable, str(args.model)
    servers = []
    if not args.skip_hf:
        port = free_port()
        servers.append(Server("transformers", [py, str(HF_SERVER), "--model", model, "--port", str(port), "--dtype",
                                               args.dtype, "--device", args.device], port))
    if args.llama_server_bin:
        if not args.llama_gguf:
            raise SystemExit("bench compare: --llama-server-bin needs --llama-gguf (the same model as a GGUF)")
        ctx = args.llama_parallel * (args.input_len + args.output_len + 16)
        for gguf in args.llama_gguf:
            port = free_port()
            name = "llama-server" if len(args.llama_gguf) == 1 else f"llama-server-{gguf_format(gguf)}"
            servers.append(Server(name, [
                args.llama_server_bin, "-m", gguf, "--host", "127.0.0.1", "--port", str(port),
                "-np", str(args.llama_parallel), "-c", str(ctx), "-t", str(args.threads), "--no-repack",
            ], port))
    def ringserve(name: str, extra: list[str]) -> Server:
        port, metrics = free_port(), free_port()
        return Server(name, [py, "-m", "ringserve.cli", "launch", "--model", model, "--port", str(port),
                             "--tokenizer-port", "0", "--scheduler-metrics-port", str(metrics), "--dtype", args.dtype,
                             "--device", args.device, *args.ringserve_arg, *extra], port, metrics_port=metrics)

    for variant in args.ringserve_variant:
        name, _, flags = variant.partition(":")
        if not name or not flags:
            raise SystemExit(f"bench compare: --ringserve-variant {variant!r}: expected NAME:FLAGS")
        servers.append(ringserve(f"ringserve-{name}", flags.split()))
    servers.append(ringserve("ringserve", []))
    return servers


def gguf_format(path: str) -> str:
    """The weight format a GGUF's file name ends with ("x.Q8_0.gguf" -> "Q8_0"; else the stem)."""
    stem = Path(path).name.removesuffix(".gguf")
    return stem.rsplit(".", 1)[-1]


def prompts_for(args: argparse.Namespace, server: str, concurrency: int) -> int:
    n = max(args.min_prompts, concurrency * args.waves)
    return min(n, args.baseline_max_prompts) if server == "transformers" else n


def run_server(server: Server, args: argparse.Namespace, vocab: int, specials: frozenset[int]) -> dict[int, dict]:
    """Start ``server``, run every level, read peak RSS, stop it. Returns level → summary."""
    out: dict[int, dict] = {}
    server.start()
    try:
        for i, c in enumerate(args.concurrency):
            n = prompts_for(args, server.name, c)
            tokenizer = local_tokenizer_info(str(args.model))[0]
            if args.workload == "copy":
                reqs = copy_requests(n, args.input_len, args.output_len, tokenizer, args.seed)
            elif args.workload == "chat":
                reqs = chat_requests(n, args.output_len, tokenizer, args.seed)
            else:
                reqs = random_requests(n, args.input_len, args.output_len, vocab, 1.0, args.seed, specials)
            cfg = ServeConfig(base_url=server.base_url, max_concurrency=c, input_len=args.input_len,
                              endpoint="completions" if args.workload == "random" else "chat",
                              output_len=args.output_len, num_prompts=n, seed=args.seed,
                              warmup_requests=1 if i == 0 else 0, progress=not args.disable_progress)
            print(f"bench: {server.name} concurrency {c}, {n} prompts", file=sys.stderr, flush=True)
            out[c], _ = asyncio.run(run_benchmark(cfg, reqs))
        server.read_peak_rss()
        server.read_speculation()
    finally:
        server.stop()
    return out


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def ringserve_quantization(args: argparse.Namespace) -> dict[str, str]:
    """Each ringserve server's ``--quantization`` value ("none" without one), by server name."""
    def quantization(flags: list[str]) -> str:
        return flags[flags.index("--quantization") + 1] if "--quantization" in flags[:-1] else "none"

    out = {f"ringserve-{v.partition(':')[0]}": quantization(args.ringserve_arg + v.partition(":")[2].split())
           for v in args.ringserve_variant}
    return {**out, "ringserve": quantization(args.ringserve_arg)}


def weight_formats(args: argparse.Namespace) -> list[str]:
    """The weight formats of the run's servers whose decode floor the table gives: the dtype,
    int8 where any ringserve (the default too, through ``--ringserve-arg``) is quantized, and
    each GGUF's."""
    formats = [args.dtype] + ["int8"] * any(q != "none" for q in ringserve_quantization(args).values())
    formats += [f for f in map(gguf_format, args.llama_gguf) if f in BYTES_PER_ELEMENT]
    return list(dict.fromkeys(formats))


def engine_alone_ms(path: Path, quantization: dict[str, str]) -> dict[str, float]:
    """The pool's batch-1 decode step (ms) of each server's weights from ``bench/cpu_pool.py
    --json``'s file ({"step_ms": {"<quantization> 1 pool": ms}}), by server; servers whose
    weights it did not run are left out."""
    steps = json.loads(Path(path).read_text())["step_ms"]
    return {s: steps[f"{q} 1 pool"] for s, q in quantization.items() if f"{q} 1 pool" in steps}


def format_table(results: dict[str, dict[int, dict]], levels: list[int]) -> str:
    """Markdown table: per level and server, completed/failed, output tok/s, medians (ms), and
    each ringserve's (the default's and every ``ringserve-NAME`` variant's) output-throughput
    ratio against each baseline; the default's also against each variant."""
    external = [s for s in results if not s.startswith("ringserve")]
    variants = [s for s in results if s.startswith("ringserve-")]
    baselines = external + variants
    head = ["conc", "server", "ok/failed", "out tok/s", "med TTFT ms", "med ITL ms", "med TPOT ms", "med E2E ms"]
    head += [f"rs/{b} tok/s" for b in baselines]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in levels:
        for name, by_level in results.items():
            s = by_level.get(c)
            if s is None:
                continue
            row = [str(c), name, f"{s['completed']}/{s['failed']}", f"{s['output_throughput']:.1f}",
                   f"{s['median_ttft_ms']:.0f}", f"{s['median_itl_ms']:.1f}", f"{s['median_tpot_ms']:.1f}",
                   f"{s['median_e2e_latency_ms']:.0f}"]
            for b in baselines:
                base = results[b].get(c)
                ours = name == "ringserve" or (name.startswith("ringserve-") and b in external)
                row.append(_ratio(s["output_throughput"], base["output_throughput"]) if ours and base else "")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from ringserve.models import DEFAULT_CACHE, SMOLLM2_DIR

    p = argparse.ArgumentParser(prog="ringserve bench compare", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_CACHE / "models" / SMOLLM2_DIR)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--device", default="cpu", help="both servers' device: cpu, cuda or cuda:N")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--waves", type=int, default=1, help="prompts per level = concurrency * waves")
    p.add_argument("--min-prompts", type=int, default=4)
    p.add_argument("--baseline-max-prompts", type=int, default=8, help="cap for the serializing transformers server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--llama-server-bin", default=None,
                   help="llama.cpp llama-server binary (bench/baselines/build_llama_server.sh builds it)")
    p.add_argument("--llama-gguf", action="append", default=[],
                   help="a GGUF of the same model for llama-server (repeat: one server each, named by format)")
    p.add_argument("--llama-parallel", type=int, default=32, help="llama-server -np slots")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ringserve-arg", action="append", default=[], help="extra flag for ringserve launch (repeat)")
    p.add_argument("--ringserve-variant", action="append", default=[], metavar="NAME:FLAGS",
                   help="also run ringserve launched with FLAGS (space-separated) as server ringserve-NAME; the "
                        "table's rs/ringserve-NAME column is the default's throughput over the variant's (repeat)")
    p.add_argument("--workload", choices=["random", "copy", "chat"], default="random",
                   help="random: random-id prompts to /v1/completions; copy: chat prompts asking to repeat a passage "
                        "of about --input-len tokens; chat: short requests for prose (ringserve.bench.workloads)")
    p.add_argument("--engine-alone-json", type=Path, default=None,
                   help="bench/cpu_pool.py --json's output: each ringserve's served ITL over its engine-alone step")
    p.add_argument("--json", default=None)
    p.add_argument("--disable-progress", action="store_true")
    args = p.parse_args(argv)

    _, vocab, specials = local_tokenizer_info(str(args.model))
    results: dict[str, dict[int, dict]] = {}
    rss: dict[str, dict[str, float]] = {}
    speculation: dict[str, dict[str, float]] = {}
    for server in build_servers(args):
        results[server.name] = run_server(server, args, vocab, specials)
        rss[server.name] = server.rss
        if server.speculation.get("drafts"):
            speculation[server.name] = server.speculation
    bandwidth = copy_bandwidth_gbps()
    floor = decode_floor_ms(args.model, args.dtype, bandwidth)
    floors = {f: decode_floor_ms(args.model, f, bandwidth) for f in weight_formats(args)}

    print(f"\n{args.model.name}, {args.dtype}, input {args.input_len}, output {args.output_len} tokens\n")
    print(format_table(results, args.concurrency))
    print("\npeak RSS (VmHWM, MiB): " + "; ".join(
        f"{srv}: " + ", ".join(f"{k} {v:.0f}" for k, v in procs.items()) for srv, procs in rss.items()))
    for srv, spec in speculation.items():
        print(f"speculative decoding, {srv}: acceptance length {spec['acceptance_length']:.2f} tokens per drafted "
              f"row, {spec['accepted_tokens']:.0f} of {spec['draft_tokens']:.0f} drafts accepted")
    print(f"decode-step floor at batch 1 (weight bytes / {bandwidth:.1f} GB/s copy bandwidth): "
          + ", ".join(f"{f} {ms:.1f} ms" for f, ms in floors.items()))
    if 1 in args.concurrency:
        quant = ringserve_quantization(args)
        engine_ms = engine_alone_ms(args.engine_alone_json, quant) if args.engine_alone_json else {}
        print(itl_ratios({s: results[s][1]["median_itl_ms"] for s in quant},
                         {s: floors["int8" if q != "none" else args.dtype] for s, q in quant.items()}, engine_ms))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                       "results": results, "peak_rss_mib": rss, "speculation": speculation,
                       "copy_bandwidth_gbps": bandwidth, "decode_floor_ms": floor,
                       "decode_floor_ms_by_format": floors}, f, indent=2)


if __name__ == "__main__":
    main()
