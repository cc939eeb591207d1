"""`ringserve launch` killed with SIGKILL (no chance to stop its children): every service
still exits, through the parent-death signal each one sets for itself after exec."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from tests.ringstack import SERVICES, launched


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_every_service_exits_when_the_launcher_is_killed(smollm2_dir: Path, tmp_path: Path) -> None:
    with launched(smollm2_dir, "--max-total-tokens", "2048", log_path=tmp_path / "ring.log") as ring:
        pids = {name: ring.pid(name) for name in SERVICES}
        assert all(_running(pid) for pid in pids.values())
        os.kill(ring.proc.pid, signal.SIGKILL)
        ring.proc.wait()
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline and any(_running(pid) for pid in pids.values()):
            time.sleep(0.2)
        assert {name: _running(pid) for name, pid in pids.items()} == dict.fromkeys(SERVICES, False)
