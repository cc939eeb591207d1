"""``ringserve launch``: run the whole ring locally as separate processes.

Starts the detokenizer, the scheduler, the tokenizer and the gateway as
separate processes on loopback, in that order (each one connects only to
services already started), waits until each reports SERVING on the standard
gRPC health service (the gateway: ``GET /health`` = 200), prints the URL and
each service's address and PID, and stops them all on Ctrl-C or SIGTERM.

``--replicas M`` starts M model replicas (each a scheduler with its own
detokenizer; with ``--tp-size N`` each scheduler is rank 0 of N and starts the other ranks
itself, so replica i takes cuda:i*N..cuda:i*N+N-1 when ``--device cuda``) and ``--tokenizers N`` N tokenizer instances, each talking to every
replica; the gateway balances over the tokenizers with gRPC's round_robin. The
port flags set the first instance's port; the others get free ports.

Ports: the gateway's HTTP port (``--port``, 8000) and the public gRPC API, the first
tokenizer's port (``--tokenizer-port``, 30010, as in the Helm chart), are fixed by default;
the internal ones are free loopback ports unless given. Every fixed port is checked before
anything starts or any model is prepared: a port in use ends the launch at once with a
message that names it and the flag that moves it.

Stopping is graceful and follows the request path: the gateway first (it stops
accepting and finishes its open responses), then the tokenizer, the scheduler
and the detokenizer, each given ``--grace-period`` seconds (plus a margin) to
exit before it is killed. If a service exits on its own, the others are stopped
and the launcher exits with status 1 — unless ``--restart-on-failure``, which
starts it again with the same flags and port (the tokenizer and the scheduler
reconnect to it with backoff).

API keys (``--api-key``, ``--api-key-file``, ``$RINGSERVE_API_KEY``) go to the gateway and
every tokenizer through the environment (``RINGSERVE_API_KEY``), never on their command
lines: the gateway requires one on its HTTP API and presents the first to the tokenizer,
which requires one on its public gRPC service.

Internal links are authenticated by default: the launcher generates a per-ring token
(``ringserve.internal_auth``; or takes ``--internal-token-file``/``$RINGSERVE_INTERNAL_TOKEN``)
and hands it to the detokenizers, schedulers and tokenizers in the environment
(``RINGSERVE_INTERNAL_TOKEN``); it is never printed. ``--insecure-skip-internal-auth``
passes that flag on instead.

Every service gets the same gRPC transport flags (``--grpc-max-message-bytes``, and
``--tls-cert-file/--tls-key-file/--tls-ca-file`` for TLS or mutual TLS); the launcher's own
health checks use them too.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve import grpcutil
from ringserve.apikeys import API_KEY_ENV, ApiKeys, add_api_key_args, api_keys_from_args
from ringserve.cli import LAUNCHER_PID_ENV
from ringserve.internal_auth import INTERNAL_TOKEN_ENV, SKIP_FLAG, InternalAuth, add_internal_auth_args, internal_auth_from_args
# free_port is imported from here by tests and benchmarks.
from ringserve.ports import DEFAULT_GRPC_PORT, DEFAULT_PORT, PortInUse, check_ports, free_port, free_ports  # noqa: F401
from services.gateway.reasoning import REASONING_PARSERS
from services.gateway.tool_parsers import TOOL_CALL_PARSERS
from services.scheduler.config import GRAMMAR_BACKENDS

STARTUP_TIMEOUT_S = 600.0
RESTART_DELAY_S = 0.5  # before restarting a service that exited (a crash loop stays slow)
STOP_MARGIN_S = 5.0  # beyond --grace-period, before a service that did not exit is killed


@dataclass(frozen=True)
class LaunchConfig:
    model: Path
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    tokenizer_port: int = DEFAULT_GRPC_PORT  # 0: pick a free loopback port
    scheduler_port: int = 0
    detokenizer_port: int = 0
    # Prometheus /metrics ports of the first instance of each gRPC service (the others, and 0:
    # a free loopback port); the gateway serves its /metrics on --port
    tokenizer_metrics_port: int = 0
    scheduler_metrics_port: int = 0
    detokenizer_metrics_port: int = 0
    dtype: str = "auto"  # the scheduler picks bf16 on AMX / AVX-512-BF16 CPUs, else fp32
    attention_backend: str = "auto"  # the scheduler picks triton on CUDA devices, cpu on CPU
    device: str = "auto"  # the scheduler's --device; "cuda" with several replicas: replica i on cuda:i
    disable_cuda_graph: bool = False
    disable_overlap_schedule: bool = False
    deterministic_inference: bool | None = None  # None: the scheduler's default (on for bf16 on the CPU)
    quantization: str | None = None  # "int8" / "int8wo": the schedulers quantize their linears at load (CPU, VNNI)
    served_model_name: str | None = None
    api_keys: ApiKeys = ApiKeys()  # required by the gateway's HTTP API and the tokenizers' gRPC API
    # The ring's internal token (a fresh one by default); empty: --insecure-skip-internal-auth.
    internal_auth: InternalAuth = field(default_factory=InternalAuth.generate)
    context_length: int | None = None
    max_running_requests: int | None = None
    max_total_tokens: int | None = None  # KV pool in tokens; None: --kv-cache-gib, else the scheduler's default
    kv_cache_gib: float | None = None
    # Without a size: this share of the memory available, split evenly over the replicas
    # (each scheduler measures the same free memory at start-up, as the pools fill lazily).
    kv_cache_mem_fraction: float = 0.3
    max_queued_requests: int | None = None
    grace_period_s: float = 5.0
    watchdog_timeout_s: float | None = None
    restart_on_failure: bool = False
    tokenizers: int = 1  # tokenizer instances, each connected to every replica
    replicas: int = 1  # model replicas: a scheduler and its detokenizer each
    chunked_prefill_size: int | None = None  # scheduler: None = its default
    tp_size: int = 1  # tensor-parallel ranks per replica (the scheduler starts ranks 1..N-1)
    dist_init_addr: str | None = None  # None: the scheduler's default (loopback)
    dist_port: int = 0  # replica i's rendezvous port: dist_port + i; 0 = a free port each
    allow_special_tokens_in_messages: bool = False
    max_queued_tokens: int | None = None
    request_timeout_s: float | None = None  # None: the gateway's default
    max_request_body_bytes: int | None = None  # None: the gateway's default
    log_requests: bool = False
    chat_template: Path | None = None  # tokenizer: a template file replacing the model's
    grammar_backend: str | None = None  # scheduler: None = its default (llguidance)
    grammar_compile_timeout_s: float | None = None
    tool_call_parser: str | None = None  # gateway: None = its default (hermes)
    reasoning_parser: str | None = None  # gateway: None = no reasoning parsing
    transport: grpcutil.Transport = grpcutil.Transport()  # every service's gRPC servers and channels
    extra_scheduler_args: tuple[str, ...] = field(default_factory=tuple)


def service_processes(launcher_pid: int, name: str) -> list[tuple[int, list[str]]]:
    """(pid, arguments after the service name) of each running process of service ``name``
    started by the launcher ``launcher_pid``.

    Found among the launcher's children by command line (Linux /proc), so it follows a
    service that ``--restart-on-failure`` started again.
    """
    try:
        with open(f"/proc/{launcher_pid}/task/{launcher_pid}/children") as f:
            children = [int(p) for p in f.read().split()]
    except FileNotFoundError:
        children = []
    out = []
    for child in children:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                args = [a.decode() for a in f.read().split(b"\0") if a]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if "ringserve.cli" in args and args[args.index("ringserve.cli") + 1 :][:1] == [name]:
            out.append((child, args[args.index("ringserve.cli") + 2 :]))
    return out


def service_pid(launcher_pid: int, name: str) -> int:
    """PID of the (first) running process of service ``name`` under the launcher ``launcher_pid``.

    Raises:
        LookupError: no such service is running under that launcher.
    """
    for pid, _ in service_processes(launcher_pid, name):
        return pid
    raise LookupError(f"no running {name} under launcher {launcher_pid}")


def grpc_serving(address: str, transport: grpcutil.Transport, timeout_s: float = 1.0, service: str = "") -> bool:
    """Whether the gRPC health service at ``address`` reports SERVING for ``service`` ("": the whole server)."""
    with grpcutil.sync_channel(address, transport) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def _http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_launched(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    """Wait until ``url`` (a launched ring's gateway /health) answers 200.

    Raises:
        RuntimeError: ``proc`` (``ringserve launch``) exited, or no 200 within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ringserve launch exited with {proc.returncode}")
        if _http_ok(url):
            return
        time.sleep(0.3)
    raise RuntimeError("ringserve launch did not become ready")


def stop_launched(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM ``ringserve launch`` (it stops its services gracefully); SIGKILL its whole
    process group after ``timeout_s``. The launcher must run in a session of its own."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _names(service: str, count: int) -> list[str]:
    """Process names: the service's name alone for one instance, else ``service-i``."""
    return [service] if count == 1 else [f"{service}-{i}" for i in range(count)]


class Launcher:
    """Owns the service processes (keyed by name: "scheduler", or "scheduler-1" with several)."""

    def __init__(self, config: LaunchConfig):
        if config.tokenizers < 1 or config.replicas < 1:
            raise ValueError("--tokenizers and --replicas must be at least 1")
        self.config = config
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.addresses: dict[str, str] = {}
        self.metrics_ports: dict[str, int] = {}  # gRPC service process name -> its Prometheus port
        self.metrics_urls: dict[str, str] = {}  # process name -> its Prometheus /metrics URL
        self._args: dict[str, list[str]] = {}

    def command(self, name: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
        """The command line and environment that start process ``name`` with ``args``."""
        service = name.split("-")[0]  # "scheduler-1" runs `ringserve scheduler`
        cmd = [sys.executable, "-m", "ringserve.cli", service, *args]
        # Idle OpenMP workers must not spin: the services share the cores.
        env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
               LAUNCHER_PID_ENV: str(os.getpid())}
        # The secrets, for the services that use them: in the environment, not on the command line.
        env.pop(API_KEY_ENV, None)
        env.pop(INTERNAL_TOKEN_ENV, None)
        if service in ("gateway", "tokenizer"):
            env.update(self.config.api_keys.env())
        if service != "gateway":  # the gateway talks to the tokenizers' public API only
            env.update(self.config.internal_auth.env())
            if not self.config.internal_auth:
                cmd.append(SKIP_FLAG)
        return cmd, env

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        cmd, env = self.command(name, args)
        # No preexec_fn: the child sets its parent-death signal itself (ringserve.cli).
        proc = subprocess.Popen(cmd, start_new_session=True, env=env)
        self.procs = [(n, p) for n, p in self.procs if n != name] + [(name, proc)]
        self._args[name] = args
        print(f"ringserve: {name} pid {proc.pid}", flush=True)
        return proc

    def _wait(self, name: str, ready) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        proc = dict(self.procs)[name]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with status {proc.returncode} during start-up")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{name} did not report SERVING within {STARTUP_TIMEOUT_S:.0f} s")

    def _start_all(self, names: list[str], args_of) -> None:
        """Spawn the instances ``names`` (args from ``args_of(i)``) at once, then wait for each."""
        for i, name in enumerate(names):
            self._spawn(name, args_of(i))
        for name in names:
            self._wait(name, lambda name=name: grpc_serving(self.addresses[name], self.config.transport))

    def start(self) -> None:
        c = self.config
        detoks, scheds, toks = _names("detokenizer", c.replicas), _names("scheduler", c.replicas), _names("tokenizer", c.tokenizers)
        first = {"detokenizer": c.detokenizer_port, "scheduler": c.scheduler_port, "tokenizer": c.tokenizer_port}
        first_metrics = {"detokenizer": c.detokenizer_metrics_port, "scheduler": c.scheduler_metrics_port,
                         "tokenizer": c.tokenizer_metrics_port}
        every = [*detoks, *scheds, *toks]
        fixed = {c.port, *first.values(), *first_metrics.values()} - {0, None}
        spare = iter(free_ports(2 * len(every), exclude=fixed))  # one gRPC + one metrics port each at most
        for names in (detoks, scheds, toks):
            for i, name in enumerate(names):
                port = (first[name.split("-")[0]] if i == 0 else 0) or next(spare)
                self.addresses[name] = f"127.0.0.1:{port}"
        health_host = "127.0.0.1" if c.host in ("0.0.0.0", "::") else c.host
        self.metrics_urls = {"gateway": f"http://{health_host}:{c.port}/metrics"}
        for names in (detoks, scheds, toks):
            for i, name in enumerate(names):
                port = (first_metrics[name.split("-")[0]] if i == 0 else 0) or next(spare)
                self.metrics_ports[name] = port
                self.metrics_urls[name] = f"http://127.0.0.1:{port}/metrics"
        model = str(c.model)
        transport = c.transport.args()

        def port_of(name: str) -> str:
            return self.addresses[name].rsplit(":", 1)[1]

        self._start_all(detoks, lambda i: ["--model", model, "--port", port_of(detoks[i]),
                                           "--grace-period", str(c.grace_period_s), *transport,
                                           *self._metrics_flags(detoks[i])])
        self._start_all(scheds, lambda i: self._scheduler_args(port_of(scheds[i]), self.addresses[detoks[i]], i)
                        + self._metrics_flags(scheds[i]))

        if c.replicas == 1:
            upstream = ["--scheduler", self.addresses[scheds[0]], "--detokenizer", self.addresses[detoks[0]]]
        else:
            upstream = [a for s, d in zip(scheds, detoks) for a in ("--replica", f"{self.addresses[s]},{self.addresses[d]}")]
        self._start_all(toks, lambda i: ["--model", model, "--port", port_of(toks[i]), *upstream, *self._tokenizer_flags(),
                                         "--metrics-port", str(self.metrics_ports[toks[i]])])

        tokenizer_target = self.addresses[toks[0]] if c.tokenizers == 1 else "ipv4:" + ",".join(self.addresses[t] for t in toks)
        gw_args = [
            "--host", c.host, "--port", str(c.port), "--tokenizer", tokenizer_target,
        ]
        if c.request_timeout_s is not None:
            gw_args += ["--request-timeout", str(c.request_timeout_s)]
        if c.max_request_body_bytes is not None:
            gw_args += ["--max-request-body-bytes", str(c.max_request_body_bytes)]
        if c.log_requests:
            gw_args.append("--log-requests")
        if c.tool_call_parser is not None:
            gw_args += ["--tool-call-parser", c.tool_call_parser]
        if c.reasoning_parser is not None:
            gw_args += ["--reasoning-parser", c.reasoning_parser]
        self._spawn("gateway", gw_args + transport)
        self._wait("gateway", lambda: _http_ok(f"http://{health_host}:{c.port}/health"))

    def topology(self) -> list[str]:
        """Lines that show who talks to whom."""
        c = self.config
        toks = [self.addresses[t] for t in _names("tokenizer", c.tokenizers)]
        lines = [f"gateway :{c.port} -> {len(toks)} tokenizer(s) {', '.join(toks)}"
                 + (" (gRPC round_robin)" if len(toks) > 1 else "")]
        for i, (s, d) in enumerate(zip(_names("scheduler", c.replicas), _names("detokenizer", c.replicas))):
            lines.append(f"replica {i}: scheduler {self.addresses[s]} -> detokenizer {self.addresses[d]}"
                         " -> every tokenizer")
        return lines

    def _metrics_flags(self, name: str) -> list[str]:
        """--metrics-port of scheduler or detokenizer ``name``, and the served name as its model_name label."""
        named = ["--served-model-name", self.config.served_model_name] if self.config.served_model_name else []
        return ["--metrics-port", str(self.metrics_ports[name]), *named]

    def _tokenizer_flags(self) -> list[str]:
        c = self.config
        args = []
        if c.served_model_name:
            args += ["--served-model-name", c.served_model_name]
        if c.context_length:
            args += ["--context-length", str(c.context_length)]
        args += ["--grace-period", str(c.grace_period_s)]
        if c.allow_special_tokens_in_messages:
            args.append("--allow-special-tokens-in-messages")
        if c.chat_template is not None:
            args += ["--chat-template", str(c.chat_template)]
        return args + c.transport.args()

    def _device(self, index: int) -> str:
        """Replica ``index``'s device: its own GPU when several replicas share "cuda"."""
        device = self.config.device
        return f"cuda:{index * self.config.tp_size}" if device == "cuda" and self.config.replicas > 1 else device

    def _scheduler_args(self, port: str, detokenizer: str, index: int) -> list[str]:
        c = self.config
        sched_args = [
            "--model", str(c.model), "--port", port,
            "--detokenizer", detokenizer, "--dtype", c.dtype, "--instance-id", f"scheduler-{index}",
            "--attention-backend", c.attention_backend, "--device", self._device(index),
        ]
        if c.chunked_prefill_size is not None:
            sched_args += ["--chunked-prefill-size", str(c.chunked_prefill_size)]
        if c.tp_size > 1:
            sched_args += ["--tp-size", str(c.tp_size)]
            if c.dist_init_addr is not None:
                sched_args += ["--dist-init-addr", c.dist_init_addr]
            if c.dist_port:
                sched_args += ["--dist-port", str(c.dist_port + index)]
        if c.disable_cuda_graph:
            sched_args.append("--disable-cuda-graph")
        if c.disable_overlap_schedule:
            sched_args.append("--disable-overlap-schedule")
        if c.deterministic_inference is not None:
            sched_args.append(f"--{'enable' if c.deterministic_inference else 'disable'}-deterministic-inference")
        if c.quantization:
            sched_args += ["--quantization", c.quantization]
        if c.max_running_requests:
            sched_args += ["--max-running-requests", str(c.max_running_requests)]
        if c.max_total_tokens:
            sched_args += ["--max-total-tokens", str(c.max_total_tokens)]
        elif c.kv_cache_gib:
            sched_args += ["--kv-cache-gib", str(c.kv_cache_gib)]
        else:
            sched_args += ["--kv-cache-mem-fraction", f"{c.kv_cache_mem_fraction / c.replicas:.6g}"]
        if c.context_length:
            sched_args += ["--context-length", str(c.context_length)]
        if c.max_queued_requests is not None:
            sched_args += ["--max-queued-requests", str(c.max_queued_requests)]
        if c.watchdog_timeout_s is not None:
            sched_args += ["--watchdog-timeout", str(c.watchdog_timeout_s)]
        if c.max_queued_tokens is not None:
            sched_args += ["--max-queued-tokens", str(c.max_queued_tokens)]
        if c.grammar_backend is not None:
            sched_args += ["--grammar-backend", c.grammar_backend]
        if c.grammar_compile_timeout_s is not None:
            sched_args += ["--grammar-compile-timeout", str(c.grammar_compile_timeout_s)]
        sched_args += ["--grace-period", str(c.grace_period_s), *c.transport.args()]
        return sched_args + list(c.extra_scheduler_args)

    def stop(self) -> None:
        """Stop the services one by one along the request path (gateway first).

        Each gets SIGTERM and ``grace_period_s + STOP_MARGIN_S`` to finish its in-flight
        requests and exit; one still running then is killed.
        """
        order = ("gateway", "tokenizer", "scheduler", "detokenizer")
        for name, proc in sorted(self.procs, key=lambda item: order.index(item[0].split("-")[0])):
            if proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.config.grace_period_s + STOP_MARGIN_S)
            except subprocess.TimeoutExpired:
                print(f"ringserve: {name} did not stop in time; killing it", file=sys.stderr)
                proc.kill()
                proc.wait()

    def watch(self) -> int:
        """Block until a service exits; return the exit status the launcher should use.

        With ``restart_on_failure`` a service that exited is started again with the same
        flags (and port) instead, and watching goes on.
        """
        while True:
            for name, proc in list(self.procs):
                if proc.poll() is None:
                    continue
                print(f"ringserve: {name} exited with status {proc.returncode}", file=sys.stderr, flush=True)
                if not self.config.restart_on_failure:
                    return 1
                time.sleep(RESTART_DELAY_S)
                self._spawn(name, self._args[name])
            time.sleep(0.2)


def parse_args(argv: list[str] | None) -> LaunchConfig:
    from ringserve.models import DEFAULT_CACHE, SMOLLM2_DIR

    parser = argparse.ArgumentParser(prog="ringserve launch", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", type=Path, default=DEFAULT_CACHE / "models" / SMOLLM2_DIR,
        help="HF-format model directory, or a GGUF file: converted once (progress bar) into the cache "
             "($RINGSERVE_CACHE_DIR/models/gguf, keyed by the file's path, size and mtime) and served from there "
             "(default: the packaged SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    parser.add_argument("--port", type=int, default=LaunchConfig.port, help="gateway HTTP port (default %(default)s)")
    parser.add_argument("--tokenizer-port", type=int, default=LaunchConfig.tokenizer_port,
                        help="the first tokenizer's port: the public gRPC API (default %(default)s); "
                             "0 (and the other tokenizers) = a free loopback port")
    parser.add_argument("--scheduler-port", type=int, default=0,
                        help="the first scheduler's port; 0 (and the others) = a free loopback port")
    parser.add_argument("--detokenizer-port", type=int, default=0,
                        help="the first detokenizer's port; 0 (and the others) = a free loopback port")
    for name in ("tokenizer", "scheduler", "detokenizer"):
        parser.add_argument(f"--{name}-metrics-port", type=int, default=0,
                            help=f"the first {name}'s Prometheus /metrics port; 0 (and the others) = a free loopback port")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="model dtype; auto = on CUDA bfloat16 (compute capability >= 8.0) else float16, on CPU bfloat16 "
             "with AMX or AVX-512-BF16 else float32; float16 on CUDA only",
    )
    parser.add_argument("--device", default=LaunchConfig.device, metavar="{auto,cpu,cuda,cuda:N}",
                        help="the schedulers' device; auto = the first CUDA device torch sees, else cpu; cuda with "
                             "--replicas N puts replica i on cuda:i")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="CUDA: run every decode step eagerly")
    det = parser.add_mutually_exclusive_group()
    det.add_argument("--enable-deterministic-inference", dest="deterministic_inference", action="store_const",
                     const=True, default=None,
                     help="schedulers: a request's tokens and logprobs do not depend on its batch, chunking or "
                          "prefix-cache hits (default: on for bf16 on the CPU, off elsewhere)")
    det.add_argument("--disable-deterministic-inference", dest="deterministic_inference", action="store_const",
                     const=False, help="schedulers: turn the default deterministic inference off")
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help="CUDA: plan each step only after the previous one's results reach the host")
    parser.add_argument("--quantization", choices=["int8", "int8wo"], default=None,
                        help="schedulers, CPU with AVX-512-VNNI: per-channel int8 linears and LM head, quantized at "
                             "load; int8: W8A8 or weight-only per shape, the faster; int8wo: weight-only (closer to "
                             "bf16); default: the checkpoint's weights in --dtype")
    parser.add_argument("--attention-backend", default=LaunchConfig.attention_backend,
                        choices=["auto", "torch", "cpu", "triton"],
                        help="scheduler: auto = triton on CUDA devices, cpu (C kernels) on CPU")
    parser.add_argument("--served-model-name", default=None)
    add_api_key_args(parser, "the gateway's HTTP API and the tokenizers' gRPC API")
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--max-running-requests", type=int, default=None)
    kv = parser.add_mutually_exclusive_group()
    kv.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens (each scheduler)")
    parser.add_argument("--kv-cache-mem-fraction", type=float, default=LaunchConfig.kv_cache_mem_fraction,
                        help="without a size: this share of the available memory for all replicas' KV pools together")
    kv.add_argument("--kv-cache-gib", type=float, default=None,
                    help="KV pool size in GiB (each scheduler); default: a share of the memory available")
    parser.add_argument("--max-queued-requests", type=int, default=None,
                        help="scheduler: requests allowed to wait for a slot; beyond it refuse (HTTP 429)")
    parser.add_argument("--grace-period", type=float, default=LaunchConfig.grace_period_s,
                        help="seconds each service gets on SIGTERM to finish in-flight requests")
    parser.add_argument("--watchdog-timeout", type=float, default=None,
                        help="scheduler: NOT_SERVING after this many seconds of work pending and no step done")
    parser.add_argument("--tokenizers", type=int, default=LaunchConfig.tokenizers,
                        help="tokenizer instances (the gateway balances over them with gRPC round_robin)")
    parser.add_argument("--replicas", type=int, default=LaunchConfig.replicas,
                        help="model replicas, each a scheduler with its detokenizer; every tokenizer "
                             "picks one per request (least outstanding work, then prefix affinity)")
    parser.add_argument("--chunked-prefill-size", type=int, default=None,
                        help="scheduler: most prompt tokens prefilled per step (<= 0: no chunking; default 2048)")
    parser.add_argument("--tp-size", type=int, default=LaunchConfig.tp_size,
                        help="tensor-parallel ranks per replica (one process and device each; the scheduler "
                             "starts them and exits when one is lost)")
    parser.add_argument("--dist-init-addr", default=None,
                        help="scheduler: address of the tensor-parallel rendezvous (default 127.0.0.1)")
    parser.add_argument("--dist-port", type=int, default=LaunchConfig.dist_port,
                        help="scheduler: replica i's tensor-parallel rendezvous port is this + i (0 = a free port)")
    parser.add_argument("--restart-on-failure", action="store_true",
                        help="restart a service that exits (same flags and port) instead of stopping all")
    parser.add_argument("--allow-special-tokens-in-messages", action="store_true",
                        help="tokenizer: parse control tokens spelled in chat messages as those tokens")
    parser.add_argument("--max-queued-tokens", type=int, default=None,
                        help="scheduler: prompt tokens held (waiting and running) plus the new request's; "
                             "beyond it refuse (HTTP 429)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="gateway: seconds a generation may take, else HTTP 504 (default: the gateway's, 600)")
    parser.add_argument("--max-request-body-bytes", type=int, default=None,
                        help="gateway: larger request bodies get HTTP 413 (default: the gateway's, 16 MiB)")
    parser.add_argument("--log-requests", action="store_true",
                        help="gateway: log prompts and outputs (never logged by default)")
    parser.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                        help="tokenizer: Jinja chat template replacing the model's "
                             "(ringserve/templates/chatml_tools.jinja: tool calling on ChatML models)")
    parser.add_argument("--grammar-backend", default=None, choices=GRAMMAR_BACKENDS,
                        help="scheduler: constrained decoding engine (default llguidance)")
    parser.add_argument("--grammar-compile-timeout", type=float, default=None,
                        help="scheduler: seconds a constrained request waits for its grammar (default 5)")
    parser.add_argument("--tool-call-parser", default=None, choices=[*TOOL_CALL_PARSERS, "none"],
                        help="gateway: format of the model's own tool calls under tool_choice auto (default hermes)")
    parser.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                        help="gateway: split <think>...</think> into reasoning_content (deepseek_r1, qwen3)")
    grpcutil.add_transport_args(parser)
    add_internal_auth_args(parser, launcher=True)
    args = parser.parse_args(argv)
    if not 0 < args.kv_cache_mem_fraction < 1:
        parser.error("--kv-cache-mem-fraction must be in (0, 1)")
    if args.tokenizers < 1 or args.replicas < 1:
        parser.error("--tokenizers and --replicas must be at least 1")
    if args.tp_size < 1:
        parser.error("--tp-size must be at least 1")
    return LaunchConfig(
        model=args.model, host=args.host, port=args.port,
        tokenizer_port=args.tokenizer_port, scheduler_port=args.scheduler_port,
        detokenizer_port=args.detokenizer_port, dtype=args.dtype,
        tokenizer_metrics_port=args.tokenizer_metrics_port, scheduler_metrics_port=args.scheduler_metrics_port,
        detokenizer_metrics_port=args.detokenizer_metrics_port, attention_backend=args.attention_backend,
        device=args.device, disable_cuda_graph=args.disable_cuda_graph,
        disable_overlap_schedule=args.disable_overlap_schedule, deterministic_inference=args.deterministic_inference,
        quantization=args.quantization,
        served_model_name=args.served_model_name, api_keys=api_keys_from_args(parser, args),
        internal_auth=internal_auth_from_args(parser, args, generate=True),
        context_length=args.context_length, max_running_requests=args.max_running_requests,
        max_total_tokens=args.max_total_tokens, kv_cache_gib=args.kv_cache_gib,
        kv_cache_mem_fraction=args.kv_cache_mem_fraction, max_queued_requests=args.max_queued_requests,
        grace_period_s=args.grace_period, watchdog_timeout_s=args.watchdog_timeout,
        restart_on_failure=args.restart_on_failure,
        tokenizers=args.tokenizers, replicas=args.replicas, tp_size=args.tp_size,
        chunked_prefill_size=args.chunked_prefill_size,
        dist_init_addr=args.dist_init_addr, dist_port=args.dist_port,
        allow_special_tokens_in_messages=args.allow_special_tokens_in_messages,
        max_queued_tokens=args.max_queued_tokens, request_timeout_s=args.request_timeout,
        max_request_body_bytes=args.max_request_body_bytes, log_requests=args.log_requests,
        chat_template=args.chat_template, grammar_backend=args.grammar_backend,
        grammar_compile_timeout_s=args.grammar_compile_timeout, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        transport=grpcutil.transport_from_args(parser, args),
    )


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    try:
        check_ports(config.host, vars(config))
    except PortInUse as exc:
        sys.exit(f"ringserve launch: {exc}")
    from ringserve.models import resolve_model

    try:
        # A GGUF is converted here, once, before any service starts; they get the directory.
        config = dataclasses.replace(config, model=resolve_model(config.model))
    except RuntimeError as exc:
        sys.exit(f"ringserve launch: {exc}")
    if not (config.model / "config.json").exists():
        from ringserve.models import DEFAULT_CACHE, SMOLLM2_DIR, prepare_smollm2

        if config.model != DEFAULT_CACHE / "models" / SMOLLM2_DIR:
            sys.exit(f"ringserve launch: {config.model} has no config.json")
        prepare_smollm2()
    launcher = Launcher(config)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    # SIGINT too: a launcher started in the background by a shell inherits SIGINT ignored,
    # and Python then never turns Ctrl-C into KeyboardInterrupt.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    status = 0
    try:
        launcher.start()
        host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
        print(f"ringserve: serving {config.model.name} at http://{host}:{config.port}/v1", flush=True)
        for name, addr in launcher.addresses.items():
            print(f"ringserve: {name} gRPC at {addr}", flush=True)
        for line in launcher.topology():
            print(f"ringserve: {line}", flush=True)
        print("ringserve: internal links " + ("authenticated by the ring's credential" if config.internal_auth else
                                               f"NOT authenticated ({SKIP_FLAG})"), flush=True)
        for name, url in launcher.metrics_urls.items():
            print(f"ringserve: {name} metrics at {url}", flush=True)
        status = launcher.watch()
    except KeyboardInterrupt:
        status = 0
    except RuntimeError as exc:
        print(f"ringserve: {exc}", file=sys.stderr)
        status = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        launcher.stop()
    sys.exit(status)


if __name__ == "__main__":
    main()
