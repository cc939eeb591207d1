"""A launched ring from the outside: its service processes, their health, waiting for it
and stopping it (used by the launcher itself, tests, benchmarks and ``ringserve health``)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve import grpcutil


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


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    """Whether ``url`` answers 200 within ``timeout_s``."""
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
        if http_ok(url):
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
