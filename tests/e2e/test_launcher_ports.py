"""`make run`'s ports. The gateway (8000) and the public gRPC API (30010) are fixed
by default; a port in use ends `ringserve launch` in under 2 s, before any model is touched,
naming the port and the flag (and make variable) that moves it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ringserve import grpcutil
from ringserve.launch import parse_args
from ringserve.ports import PortInUse, check_ports, free_ports
from tests.helpers.repo import run_make

REPO = Path(__file__).resolve().parents[2]


@contextmanager
def listening(host: str = "127.0.0.1") -> Iterator[int]:
    """A socket listening on a free port of ``host``, as another server would hold it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        s.listen()
        yield s.getsockname()[1]


def launch_fails(*flags: str, tmp_path: Path) -> tuple[str, float]:
    """Run `ringserve launch` with a model directory that does not exist; return its stderr
    and how long it took. Only the port check can end it before the model is looked at."""
    cmd = [sys.executable, "-m", "ringserve.cli", "launch", "--model", str(tmp_path / "no-model"), *flags]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO)
    elapsed = time.monotonic() - t0
    assert out.returncode == 1, out.stderr
    return out.stderr.strip().splitlines()[-1], elapsed


def test_default_ports_are_fixed() -> None:
    config = parse_args(["--model", "m"])
    assert (config.port, config.tokenizer_port) == (8000, 30010)
    assert (config.scheduler_port, config.detokenizer_port) == (0, 0)
    assert parse_args(["--model", "m", "--tokenizer-port", "0"]).tokenizer_port == 0


@pytest.mark.parametrize("flag, what, make_var", [("--port", "gateway HTTP", "PORT"),
                                                    ("--tokenizer-port", "tokenizer gRPC API", "GRPC_PORT")])
def test_port_in_use_fails_fast(flag: str, what: str, make_var: str, tmp_path: Path) -> None:
    ports = dict(zip(("--port", "--tokenizer-port"), map(str, free_ports(2)), strict=True))
    with listening() as port:
        ports[flag] = str(port)
        line, elapsed = launch_fails(*(a for item in ports.items() for a in item), tmp_path=tmp_path)
    assert line == (f"ringserve launch: port {port} ({what}, {flag}) on 127.0.0.1 is already in use; "
                    f"choose another with {flag} N (make run: {make_var}=N)")
    assert elapsed < 2.0


def test_internal_and_metrics_ports_are_checked_too() -> None:
    http_port, grpc_port = free_ports(2)
    with listening() as port:
        for flag, what in (("--scheduler-port", "scheduler gRPC"),
                           ("--detokenizer-metrics-port", "detokenizer metrics")):
            config = parse_args(["--model", "m", "--port", str(http_port), "--tokenizer-port", str(grpc_port),
                                 flag, str(port)])
            with pytest.raises(PortInUse) as info:
                check_ports(config.host, vars(config))
            assert str(info.value) == (f"port {port} ({what}, {flag}) on 127.0.0.1 is already in use; "
                                       f"choose another with {flag} N")


def test_one_port_given_twice() -> None:
    (port,) = free_ports(1)
    config = parse_args(["--model", "m", "--port", str(port), "--tokenizer-port", str(port)])
    with pytest.raises(PortInUse) as info:
        check_ports(config.host, vars(config))
    assert str(info.value) == (f"port {port} is given to both --port and --tokenizer-port; "
                               "move one with --tokenizer-port N (make run: GRPC_PORT=N)")


def test_free_ports_pass() -> None:
    http_port, grpc_port = free_ports(2)
    config = parse_args(["--model", "m", "--port", str(http_port), "--tokenizer-port", str(grpc_port)])
    check_ports(config.host, vars(config))


async def test_grpc_server_does_not_share_a_taken_port() -> None:
    """gRPC's default SO_REUSEPORT would let a second server bind the port silently."""
    first = await grpcutil.start_server("127.0.0.1:0", [])
    try:
        with pytest.raises(RuntimeError, match="(?i)bind"):
            await grpcutil.start_server(f"127.0.0.1:{first.port}", [])
    finally:
        await first.server.stop(None)


def test_make_run_checks_its_ports_before_setup() -> None:
    """`make run` checks PORT and GRPC_PORT with the system Python before it sets anything up."""
    (grpc_port,) = free_ports(1)
    with listening() as port:
        t0 = time.monotonic()
        out = run_make("ports-free", f"PORT={port}", f"GRPC_PORT={grpc_port}", check=False)
        elapsed = time.monotonic() - t0
    assert out.returncode != 0 and elapsed < 2.0
    assert out.stderr.splitlines()[0] == (f"ringserve launch: port {port} (gateway HTTP, --port) on 127.0.0.1 is "
                                          "already in use; choose another with --port N (make run: PORT=N)")
    dry = run_make("-n", "run", "PORT=8123", "GRPC_PORT=30123").stdout.splitlines()
    assert dry[0] == "python3 -m ringserve.ports --host 127.0.0.1 --port 8123 --tokenizer-port 30123"
    assert dry[-1].endswith("ringserve launch --model "
                            f"{Path.home()}/.cache/ringserve/models/SmolLM2-135M-Instruct --host 127.0.0.1 --port 8123 "
                            "--tokenizer-port 30123")
    dry = run_make("-n", "run", "RUN_ARGS=--quantization int8").stdout.splitlines()
    assert dry[-1].endswith("--tokenizer-port 30010 --quantization int8")
