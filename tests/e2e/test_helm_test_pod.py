"""The chart's `helm test` pod (templates/tests/chat.yaml) runs its script against the
gateway Service. Here the same script, taken from the rendered pod, runs against the launched
ring with the pod's environment pointed at it: the check a cluster would run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers.helm import CHART, RELEASE


def rendered_test_pod(helm_bin: Path, *sets: str) -> dict:
    out = subprocess.run([str(helm_bin), "template", RELEASE, str(CHART), "--show-only", "templates/tests/chat.yaml",
                          *[a for s in sets for a in ("--set", s)]],
                         capture_output=True, text=True, timeout=60, check=True)
    return yaml.safe_load(out.stdout)


def test_helm_test_pod_gets_an_answer_from_the_ring(helm: Path, stack) -> None:
    pod = rendered_test_pod(helm)
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    chat = pod["spec"]["containers"][0]
    assert chat["image"] == "ghcr.io/ringserve/ringserve-gateway:0.1.0"
    env = {e["name"]: e["value"] for e in chat["env"]}
    assert env == {"URL": "http://rs-ringserve-gateway:80/v1/chat/completions", "MODEL": "SmolLM2-135M-Instruct"}
    assert chat["command"][:2] == ["python", "-c"]
    env = {**os.environ, "URL": f"{stack.base_url}/v1/chat/completions", "MODEL": stack.model_name}
    out = subprocess.run([sys.executable, "-c", chat["command"][2]], env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "SmolLM2-135M-Instruct: 'The capital of France is Paris.' (8 tokens)\n"


def test_helm_test_pod_sends_the_api_key(helm: Path) -> None:
    pod = rendered_test_pod(helm, "apiKey.enabled=true", "apiKey.value=sk-x")
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["RINGSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "rs-ringserve-api-key", "key": "api-key"}
