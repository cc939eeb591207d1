"""The launcher: starts the services of a ring in order, waits for each, watches and stops them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ringserve.apikeys import API_KEY_ENV
from ringserve.cli import LAUNCHER_PID_ENV
from ringserve.internal_auth import INTERNAL_TOKEN_ENV, SKIP_FLAG
from ringserve.launch.flags import LaunchConfig
from ringserve.launch.processes import grpc_serving, http_ok
from ringserve.ports import free_ports

STARTUP_TIMEOUT_S = 600.0
RESTART_DELAY_S = 0.5  # before restarting a service that exited (a crash loop stays slow)
STOP_MARGIN_S = 5.0  # beyond --grace-period, before a service that did not exit is killed


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

    def _start_all(self, names: list[str]) -> None:
        """Spawn the instances ``names`` at once, then wait for each to report SERVING."""
        for name in names:
            self._spawn(name, self.args(name))
        for name in names:
            self._wait(name, lambda name=name: grpc_serving(self.addresses[name], self.config.transport))

    def plan(self) -> None:
        """Give every gRPC service process its address and metrics port: the first of each
        service the port its flag names, the others (and 0) a free loopback port."""
        c = self.config
        first = {"detokenizer": c.detokenizer_port, "scheduler": c.scheduler_port, "tokenizer": c.tokenizer_port}
        first_metrics = {"detokenizer": c.detokenizer_metrics_port, "scheduler": c.scheduler_metrics_port,
                         "tokenizer": c.tokenizer_metrics_port}
        groups = [_names("detokenizer", c.replicas), _names("scheduler", c.replicas), _names("tokenizer", c.tokenizers)]
        fixed = {c.port, *first.values(), *first_metrics.values()} - {0, None}
        spare = iter(free_ports(2 * sum(map(len, groups)), exclude=fixed))  # one gRPC + one metrics port each at most
        for names in groups:
            for i, name in enumerate(names):
                port = (first[name.split("-")[0]] if i == 0 else 0) or next(spare)
                self.addresses[name] = f"127.0.0.1:{port}"
        self.metrics_urls = {"gateway": f"http://{self._health_host}:{c.port}/metrics"}
        for names in groups:
            for i, name in enumerate(names):
                port = (first_metrics[name.split("-")[0]] if i == 0 else 0) or next(spare)
                self.metrics_ports[name] = port
                self.metrics_urls[name] = f"http://127.0.0.1:{port}/metrics"

    @property
    def _health_host(self) -> str:
        return "127.0.0.1" if self.config.host in ("0.0.0.0", "::") else self.config.host

    def args(self, name: str) -> list[str]:
        """The flags process ``name`` ("tokenizer", "scheduler-1", ...) starts with (after ``plan``):
        what the launcher decides for it, then the options it passes on to its service."""
        c = self.config
        service, _, index = name.partition("-")
        i = int(index or 0)
        if service == "gateway":
            toks = [self.addresses[t] for t in _names("tokenizer", c.tokenizers)]
            target = toks[0] if len(toks) == 1 else "ipv4:" + ",".join(toks)
            return ["--host", c.host, "--port", str(c.port), "--tokenizer", target,
                    "--grace-period", str(c.grace_period_s), *c.transport.args(), *c.passed("gateway")]
        port = self.addresses[name].rsplit(":", 1)[1]
        if service == "scheduler":
            return self._scheduler_args(port, self.addresses[_names("detokenizer", c.replicas)[i]], i) \
                + self._metrics_flags(name)
        upstream: list[str] = []
        if service == "tokenizer":
            pairs = list(zip(_names("scheduler", c.replicas), _names("detokenizer", c.replicas), strict=True))
            if c.replicas == 1:
                upstream = ["--scheduler", self.addresses[pairs[0][0]], "--detokenizer", self.addresses[pairs[0][1]]]
            else:
                upstream = [a for s, d in pairs for a in ("--replica", f"{self.addresses[s]},{self.addresses[d]}")]
        return ["--model", str(c.model), "--port", port, *upstream, "--grace-period", str(c.grace_period_s),
                *c.transport.args(), *self._metrics_flags(name), *c.passed(service)]

    def start(self) -> None:
        """Start every service in ring order, each instance of a service at once, waiting
        until each reports SERVING before the next service starts.

        Raises:
            RuntimeError: a service exited or did not become ready in ``STARTUP_TIMEOUT_S``.
        """
        c = self.config
        self.plan()
        for names in (_names("detokenizer", c.replicas), _names("scheduler", c.replicas),
                      _names("tokenizer", c.tokenizers)):
            self._start_all(names)
        self._spawn("gateway", self.args("gateway"))
        self._wait("gateway", lambda: http_ok(f"http://{self._health_host}:{c.port}/health"))

    def topology(self) -> list[str]:
        """Lines that show who talks to whom."""
        c = self.config
        toks = [self.addresses[t] for t in _names("tokenizer", c.tokenizers)]
        lines = [f"gateway :{c.port} -> {len(toks)} tokenizer(s) {', '.join(toks)}"
                 + (" (gRPC round_robin)" if len(toks) > 1 else "")]
        pairs = zip(_names("scheduler", c.replicas), _names("detokenizer", c.replicas), strict=True)
        for i, (s, d) in enumerate(pairs):
            part = "" if not c.prefill_replicas else (" (prefill)" if i < c.prefill_replicas else " (decode)")
            lines.append(f"replica {i}{part}: scheduler {self.addresses[s]} -> detokenizer {self.addresses[d]}"
                         " -> every tokenizer")
        return lines

    def _metrics_flags(self, name: str) -> list[str]:
        """--metrics-port of gRPC service process ``name``."""
        return ["--metrics-port", str(self.metrics_ports[name])]

    def _device(self, index: int) -> str:
        """Replica ``index``'s device: its own GPU when several replicas share "cuda"."""
        device = self.config.device
        return f"cuda:{index * self.config.tp_size}" if device == "cuda" and self.config.replicas > 1 else device

    def _scheduler_args(self, port: str, detokenizer: str, index: int) -> list[str]:
        """Scheduler ``index``'s flags: what the launcher decides for each replica, then what it passes on."""
        c = self.config
        args = ["--model", str(c.model), "--port", port, "--detokenizer", detokenizer,
                "--instance-id", f"scheduler-{index}", "--device", self._device(index),
                "--grace-period", str(c.grace_period_s), *c.transport.args()]
        if c.tp_size > 1:
            args += ["--tp-size", str(c.tp_size)]
            if c.dist_port:
                args += ["--dist-port", str(c.dist_port + index)]
        if c.prefill_replicas:  # disaggregated: the first ones prefill, the others decode
            args += ["--disaggregation-mode", "prefill" if index < c.prefill_replicas else "decode"]
        if c.kv_cache_mem_fraction is not None:  # no KV pool size given: each replica takes its share
            args += ["--kv-cache-mem-fraction", f"{c.kv_cache_mem_fraction / c.replicas:.6g}"]
        return args + list(c.passed("scheduler"))

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
