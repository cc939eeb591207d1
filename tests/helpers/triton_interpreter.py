"""Triton kernels run under Triton's interpreter, in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.repo import REPO


def run_interpreted(script: str, timeout_s: float = 300) -> dict:
    """Run ``script`` in a subprocess with Triton's interpreter on (TRITON_INTERPRET must be set
    before triton is imported) from the repository root; returns the JSON of its last line."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
