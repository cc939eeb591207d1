"""The whole ring, launched once per test session with the real SmolLM2 model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from ringserve.launch import free_port
from ringserve.v1 import common_pb2, detokenizer_pb2_grpc, scheduler_pb2_grpc, tokenizer_pb2_grpc


@dataclass
class Stack:
    base_url: str
    tokenizer: str
    scheduler: str
    detokenizer: str
    model_name: str
    proc: subprocess.Popen

    def scheduler_load(self) -> common_pb2.LoadReport:
        with grpc.insecure_channel(self.scheduler) as ch:
            return scheduler_pb2_grpc.SchedulerStub(ch).GetLoad(common_pb2.Empty(), timeout=5)

    def tokenizer_load(self) -> common_pb2.LoadReport:
        with grpc.insecure_channel(self.tokenizer) as ch:
            return tokenizer_pb2_grpc.TokenizerStub(ch).GetLoad(common_pb2.Empty(), timeout=5)

    def detokenizer_load(self) -> common_pb2.LoadReport:
        with grpc.insecure_channel(self.detokenizer) as ch:
            return detokenizer_pb2_grpc.DetokenizerStub(ch).GetLoad(common_pb2.Empty(), timeout=5)

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


def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ringserve launch exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("ringserve launch did not become ready")


@pytest.fixture(scope="session")
def stack(smollm2_dir: Path):
    ports = {name: free_port() for name in ("http", "tokenizer", "scheduler", "detokenizer")}
    cmd = [
        sys.executable, "-m", "ringserve.cli", "launch", "--model", str(smollm2_dir),
        "--port", str(ports["http"]), "--tokenizer-port", str(ports["tokenizer"]),
        "--scheduler-port", str(ports["scheduler"]), "--detokenizer-port", str(ports["detokenizer"]),
        "--dtype", "float32",
    ]
    proc = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{ports['http']}"
    try:
        _wait_ready(proc, f"{base}/health", timeout_s=300)
        yield Stack(
            base_url=base,
            tokenizer=f"127.0.0.1:{ports['tokenizer']}",
            scheduler=f"127.0.0.1:{ports['scheduler']}",
            detokenizer=f"127.0.0.1:{ports['detokenizer']}",
            model_name=smollm2_dir.name,
            proc=proc,
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
