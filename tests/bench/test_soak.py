"""``ringserve bench soak`` (make soak), shortened: 14 s, 8 streams, the scheduler killed at 5 s."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from ringserve.bench.soak import GAUGES, SoakConfig, Tally, report

BASELINE = [
    "gauges at the end (baseline 0):",
    "  tokenizer: req_states=0",
    "  scheduler: num_running_reqs=0 num_waiting_reqs=0 req_slots_used=0 kv_used_tokens=0",
    "  detokenizer: decode_states=0",
    "result: OK: every gauge back to baseline, no request hung",
]


@pytest.mark.ring  # `ringserve bench soak` launches its own ring
def test_short_soak_with_a_scheduler_kill_ends_at_baseline(smollm2_dir, tmp_path):
    log = tmp_path / "ring.log"
    proc = subprocess.run(
        [sys.executable, "-m", "ringserve.cli", "bench", "soak", "--model", str(smollm2_dir), "--dtype", "float32",
         "--duration", "14", "--streams", "8", "--kill-at", "5", "--log", str(log)],
        capture_output=True, text=True, timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    lines = out.splitlines()
    assert lines[-len(BASELINE):] == BASELINE, out
    assert re.search(r"scheduler \(pid \d+\) killed at 5\.\d s, serving again [\d.]+ s later", out), out
    done = re.search(r"requests done: (\d+) \(completed (\d+), disconnected by the client (\d+), "
                     r"errors (\d+), hung 0\)", out)
    assert done, out
    total, completed, disconnected, errors = map(int, done.groups())
    assert total == completed + disconnected + errors and completed > 0, out
    assert re.search(r"TTFT p50 [\d.]+ ms, p99 [\d.]+ ms", out) and re.search(r"ITL  p50 [\d.]+ ms", out), out
    # The kill really happened: the launcher saw the scheduler die and started it again.
    assert "scheduler exited with status -9" in log.read_text(), log.read_text()[-2000:]


def test_report_fails_on_a_gauge_off_baseline_or_a_hung_request(capsys):
    cfg = SoakConfig(model=Path("."), duration_s=1)
    zero = {g: 0 for g in GAUGES}
    assert report(cfg, Tally(Counter(ok=3)), "no scheduler kill", zero, 1.0)
    leaked = {**zero, ("scheduler", "kv_used_tokens"): 16}
    assert not report(cfg, Tally(Counter(ok=3)), "no scheduler kill", leaked, 1.0)
    assert capsys.readouterr().out.splitlines()[-1] == "result: FAILED: gauges not back to baseline"
    assert not report(cfg, Tally(Counter(ok=3, hung=1)), "no scheduler kill", zero, 1.0)
    out = capsys.readouterr().out
    assert "errors by kind:\n  hung: 1\n" in out and out.splitlines()[-1] == "result: FAILED: 1 requests hung"
