"""Where the repository and the model cache are, and ``make`` run as a user would type it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ringserve import models

REPO = Path(__file__).resolve().parents[2]
CACHE_DIR = Path(os.environ.get("RINGSERVE_CACHE_DIR", models.DEFAULT_CACHE))


def run_make(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``make ARGS`` in the repository, as a user would type it: without the variables and
    flags of a `make test` that runs these tests (MAKEFLAGS would pass its command-line
    variables on, MAKELEVEL would add "Entering directory" lines)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    return subprocess.run(["make", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=check)
