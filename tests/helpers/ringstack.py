"""The whole ring, launched by tests as a user would: ``ringserve launch`` with the real model.

The session fixture ``stack`` (tests/conftest.py) is one shared ring for every test that
leaves it healthy. Fault and overload tests launch a separate ring with ``launched(...)``
(fresh ports), from a fixture declared with ``ring_fixture`` (tests/helpers/tiers.py), and
may kill, stop, restart or saturate its services; the services are the launcher's children,
and ``pid(name)`` finds the current process of one by its command line, so it follows a
service that ``--restart-on-failure`` started again. Each ring gets its own internal
credential (``$RINGSERVE_INTERNAL_TOKEN`` for the launcher); ``internal_metadata`` presents
it on the scheduler's and detokenizer's ports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from ringserve.internal_auth import InternalAuth
from ringserve.launch import free_port, service_processes, stop_launched
from ringserve.launch import wait_launched as wait_ready
from ringserve.ports import free_ports
from ringserve.v1 import common_pb2, detokenizer_pb2_grpc, scheduler_pb2_grpc, tokenizer_pb2_grpc


@dataclass
class Stack:
    base_url: str
    tokenizer: str
    scheduler: str
    detokenizer: str
    model_name: str
    proc: subprocess.Popen
    metrics_urls: dict[str, str]  # service -> its Prometheus /metrics URL
    # Metadata of the tokenizer calls made here: the API key of a ring launched with --api-key.
    grpc_metadata: tuple[tuple[str, str], ...] = ()
    # Headers of the gateway calls a test makes: the same key, as an Authorization header.
    http_headers: dict[str, str] = field(default_factory=dict)
    # Metadata of the scheduler and detokenizer calls made here: the ring's internal credential.
    internal_metadata: tuple[tuple[str, str], ...] = ()

    def scrape(self, name: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of service ``name``'s /metrics: (sample name, sorted labels) -> value."""
        r = httpx.get(self.metrics_urls[name], timeout=10)
        assert r.status_code == 200, r.text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text)
            for s in family.samples
        }

    def scheduler_load(self) -> common_pb2.LoadReport:
        with grpc.insecure_channel(self.scheduler) as ch:
            return scheduler_pb2_grpc.SchedulerStub(ch).GetLoad(common_pb2.Empty(), timeout=5,
                                                                 metadata=self.internal_metadata)

    def tokenizer_load(self) -> common_pb2.LoadReport:
        with grpc.insecure_channel(self.tokenizer) as ch:
            return tokenizer_pb2_grpc.TokenizerStub(ch).GetLoad(common_pb2.Empty(), timeout=5,
                                                                 metadata=self.grpc_metadata)

    def detokenizer_load(self) -> common_pb2.LoadReport:
        with grpc.insecure_channel(self.detokenizer) as ch:
            return detokenizer_pb2_grpc.DetokenizerStub(ch).GetLoad(common_pb2.Empty(), timeout=5,
                                                                     metadata=self.internal_metadata)

    def wait_idle(self, timeout_s: float = 10.0) -> tuple[common_pb2.LoadReport, ...]:
        """Wait until no service holds any request state; return the three load reports.

        Raises:
            AssertionError: state is still held after ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            loads = (self.tokenizer_load(), self.scheduler_load(), self.detokenizer_load())
            tok, sched, detok = loads
            idle = (
                tok.req_states == 0
                and sched.num_running_reqs == 0
                and sched.num_waiting_reqs == 0
                and sched.req_slots_used == 0
                and sched.kv_used_tokens == 0
                and detok.decode_states == 0
            )
            if idle:
                return loads
            if time.monotonic() > deadline:
                raise AssertionError(f"state not released: {loads}")
            time.sleep(0.05)


SERVICES = ("gateway", "tokenizer", "scheduler", "detokenizer")

# Rings launched by this process so far: the root conftest fails a test outside the ring tier
# that launched one.
launches = 0


def still_serves(stack: Stack) -> None:
    """The ring still answers a known greedy question correctly and goes back to idle."""
    resp = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60, json={
        "model": stack.model_name, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    stack.wait_idle(timeout_s=5)


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@dataclass
class OwnStack(Stack):
    log_path: Path | None = None  # the launcher's and the services' stdout and stderr

    def log(self) -> str:
        assert self.log_path is not None
        return self.log_path.read_text(errors="replace")

    def _instances(self, name: str) -> list[tuple[int, list[str]]]:
        """(pid, arguments after the service name) of each running process of service ``name``."""
        assert name in SERVICES
        return service_processes(self.proc.pid, name)

    def pid(self, name: str, address: str | None = None) -> int:
        """PID of the running process of service ``name`` (a child of the launcher); with
        several instances, ``address`` ("127.0.0.1:port") picks the one listening there."""
        for child, args in self._instances(name):
            if address is None or f"127.0.0.1:{_flag(args, '--port')}" == address:
                return child
        raise LookupError(f"no running {name} {address or ''} under launcher {self.proc.pid}")

    def replicas(self) -> list[tuple[str, str]]:
        """(scheduler, detokenizer) address of every model replica, ordered by scheduler instance id."""
        found = sorted((_flag(args, "--instance-id"), _flag(args, "--port"), _flag(args, "--detokenizer"))
                       for _, args in self._instances("scheduler"))
        return [(f"127.0.0.1:{port}", detok) for _, port, detok in found]

    def kill(self, name: str, address: str | None = None) -> int:
        """SIGKILL service ``name`` (the instance at ``address`` if given); return its PID."""
        pid = self.pid(name, address)
        os.kill(pid, signal.SIGKILL)
        return pid

    def serving(self, name: str, timeout_s: float = 1.0) -> bool:
        """Whether gRPC service ``name`` answers SERVING on the health service."""
        address = getattr(self, name)
        with grpc.insecure_channel(address) as ch:
            try:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
            except grpc.RpcError:
                return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING

    def wait_serving(self, name: str, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.serving(name):
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} not SERVING after {timeout_s:.0f} s")
            time.sleep(0.2)


@contextmanager
def launched_gateway(tokenizer: str, *flags: str, log_path: Path | None = None) -> Iterator[str]:
    """A second gateway process (``ringserve gateway FLAGS``) on a ring's tokenizer at
    ``tokenizer``, until the block ends; yields its base URL once ``/health`` is 200. A gateway
    holds no state, so a flag of its own needs no ring of its own. With ``log_path`` its output
    goes to that file."""
    port = free_port()
    log = open(log_path, "w") if log_path is not None else None  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([sys.executable, "-m", "ringserve.cli", "gateway", "--port", str(port),
                             "--tokenizer", tokenizer, *flags],
                            stdout=log, stderr=subprocess.STDOUT if log else None)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, f"{base}/health", timeout_s=60)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)
        if log is not None:
            log.close()


@contextmanager
def launched(model_dir: Path, *extra: str, log_path: Path | None = None,
             sigint_ignored: bool = False, env: dict[str, str] | None = None) -> Iterator[OwnStack]:
    """Launch a ring with ``extra`` launcher flags; stop it (SIGTERM, then SIGKILL) at the end.

    With ``log_path`` every process's output goes to that file instead of the test's. ``env``
    adds to the environment the ring's processes inherit. With
    ``sigint_ignored`` the launcher inherits SIGINT ignored, as from a non-interactive shell
    that starts it with ``&`` (``trap "" INT``).
    """
    global launches
    launches += 1
    # Seven distinct ports from one call: one at a time, the kernel may hand a port out twice.
    picked = iter(free_ports(7))
    ports = {name: next(picked) for name in ("http", "tokenizer", "scheduler", "detokenizer")}
    metrics_ports = {name: next(picked) for name in ("tokenizer", "scheduler", "detokenizer")}
    cmd = [
        sys.executable, "-m", "ringserve.cli", "launch", "--model", str(model_dir),
        "--port", str(ports["http"]), "--tokenizer-port", str(ports["tokenizer"]),
        "--scheduler-port", str(ports["scheduler"]), "--detokenizer-port", str(ports["detokenizer"]),
        "--dtype", "float32",
        *(arg for name, port in metrics_ports.items() for arg in (f"--{name}-metrics-port", str(port))),
        *extra,
    ]
    if sigint_ignored:
        cmd = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *cmd]
    auth = InternalAuth.generate()
    log = open(log_path, "w") if log_path is not None else None  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **auth.env(), **(env or {})},
                            stdout=log, stderr=subprocess.STDOUT if log else None)
    base = f"http://127.0.0.1:{ports['http']}"
    try:
        wait_ready(proc, f"{base}/health", timeout_s=300)
        yield OwnStack(
            base_url=base,
            tokenizer=f"127.0.0.1:{ports['tokenizer']}",
            scheduler=f"127.0.0.1:{ports['scheduler']}",
            detokenizer=f"127.0.0.1:{ports['detokenizer']}",
            model_name=model_dir.name,
            proc=proc,
            metrics_urls={"gateway": f"{base}/metrics",
                          **{name: f"http://127.0.0.1:{port}/metrics" for name, port in metrics_ports.items()}},
            log_path=log_path,
            internal_metadata=auth.metadata(),
        )
    finally:
        stop_launched(proc)
        if log is not None:
            log.close()
