"""Fixtures shared by every test: the packaged models, converted once per machine."""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path

# torch's OpenMP workers spin while idle unless told otherwise; with several
# processes sharing 2 cores (the services, the test process) that spinning
# made decode steps 5-25x slower. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Services that tests parse or start alone need the ring's internal credential, as a
# deployment gives them one (ringserve.internal_auth); each launched ring gets its own.
os.environ.setdefault("RINGSERVE_INTERNAL_TOKEN", secrets.token_urlsafe(32))

import pytest

from ringserve import models

CACHE_DIR = Path(os.environ.get("RINGSERVE_CACHE_DIR", models.DEFAULT_CACHE))
REPO = Path(__file__).resolve().parents[1]


def run_make(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``make ARGS`` in the repository, as a user would type it: without the variables and
    flags of a `make test` that runs these tests (MAKEFLAGS would pass its command-line
    variables on, MAKELEVEL would add "Entering directory" lines)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    return subprocess.run(["make", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=check)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """HF-format SmolLM2-135M-Instruct directory (config.json, model.safetensors, tokenizer.json)."""
    return models.prepare_smollm2(CACHE_DIR)


@pytest.fixture(scope="session")
def stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The whole ring serving SmolLM2 in fp32, launched once per test session (tests/ringstack.py);
    its services write to a file (``stack.log()``), so tests can check what bad input logs."""
    from tests.ringstack import launched

    with launched(smollm2_dir, log_path=tmp_path_factory.mktemp("stack") / "ring.log") as ring:
        yield ring
