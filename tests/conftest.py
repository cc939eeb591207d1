"""Fixtures shared by every test (the packaged models, converted once per machine; the shared
ring) and the tiers: each collected test gets its ``unit``, ``model`` or ``ring`` marker from
the fixtures it uses (tests/helpers/tiers.py), so ``pytest -m unit`` runs the fast tier."""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
from pathlib import Path

# torch's OpenMP workers spin while idle unless told otherwise; with several
# processes sharing 2 cores (the services, the test process) that spinning
# made decode steps 5-25x slower. Must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Services that tests parse or start alone need the ring's internal credential, as a
# deployment gives them one (ringserve.internal_auth); each launched ring gets its own.
os.environ.setdefault("RINGSERVE_INTERNAL_TOKEN", secrets.token_urlsafe(32))
# Where the environment says not to write bytecode (PYTHONDONTWRITEBYTECODE, as container images
# often do), every process the suite starts (each ring's services, the CLI, the scripts run in a
# subprocess) compiled torch's, transformers' and the repository's sources again: 4-5 s of each
# start-up on 2 cores. The session keeps the bytecode instead, outside the tree and the venv.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    sys.pycache_prefix = os.environ.setdefault(
        "PYTHONPYCACHEPREFIX", str(Path(tempfile.gettempdir()) / f"ringserve-pycache-{os.getuid()}"))
    sys.dont_write_bytecode = False

import pytest

from ringserve import models
from tests.helpers import ringstack
from tests.helpers.helm import helm_binary
from tests.helpers.repo import CACHE_DIR
from tests.helpers.tiers import model_fixture, refuse_unmarked_launch, ring_fixture, tier_of


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its tier; run the tests that end a session ring after all others."""
    for item in items:
        tier = tier_of(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(tier)
    items.sort(key=lambda item: item.get_closest_marker("ends_ring") is not None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    return (yield from _refuse_unmarked_launch(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    return (yield from _refuse_unmarked_launch(item))


def _refuse_unmarked_launch(item: pytest.Item):
    before = ringstack.launches
    result = yield
    refuse_unmarked_launch(item, before, ringstack.launches)
    return result


@model_fixture(scope="session")
def smollm2_dir() -> Path:
    """HF-format SmolLM2-135M-Instruct directory (config.json, model.safetensors, tokenizer.json)."""
    return models.prepare_smollm2(CACHE_DIR)


@ring_fixture(scope="session")
def stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The whole ring serving SmolLM2 in fp32, launched once per test session (tests/helpers/ringstack.py);
    its services write to a file (``stack.log()``), so tests can check what bad input logs. It
    starts as a shell's background job does, with SIGINT ignored: the last test of a session
    (tests/e2e/test_launcher_orphans.py) stops it with Ctrl-C."""
    with ringstack.launched(smollm2_dir, log_path=tmp_path_factory.mktemp("stack") / "ring.log",
                            sigint_ignored=True) as ring:
        yield ring


@pytest.fixture(scope="session")
def helm() -> Path:
    """The Helm 3 binary (tests/helpers/helm.py), fetched once per machine."""
    return helm_binary()
