"""The install commands of deploy/helm/README.md ("Install, step by step"), run as far as this
machine can (no Docker engine, no cluster): `make -n` for the image builds, `helm template`
with the exact `helm install` flags, and the objects the check step names must be in that
render."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import yaml

from tests.helpers.helm import K8S_VERSION, by
from tests.helpers.repo import run_make

REPO = Path(__file__).resolve().parents[2]


def deploy_commands() -> list[list[str]]:
    """The commands of the section's sh block, continuation lines joined, comments and
    trailing `&` dropped."""
    readme = (REPO / "deploy" / "helm" / "README.md").read_text()
    section = readme.split("\n## Install, step by step\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", section, re.S)[1]
    joined = block.replace("\\\n", " ")
    return [shlex.split(line.rstrip(" &")) for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_readme_deploy_commands_hold(helm: Path) -> None:
    cmds = deploy_commands()
    assert [c[:2] for c in cmds] == [["make", "images"], ["make", "push-images"], ["helm", "install"],
                                     ["kubectl", "-n"], ["helm", "test"], ["kubectl", "-n"], ["kubectl", "-n"],
                                     ["curl", "http://127.0.0.1:8000/v1/models"],
                                     [".venv/bin/python", "examples/grpc_chat.py"]]
    # 1. The image builds: every tag under the registry the install step points at.
    builds = [b for b in run_make("-n", *cmds[0][1:]).stdout.splitlines() if b.startswith("docker build ")]
    tags = [shlex.split(b)[shlex.split(b).index("-t") + 1] for b in builds]
    assert len(tags) == 4 and all(t.startswith("registry.example.com/ringserve/ringserve-") for t in tags)
    push = run_make("-n", *cmds[1][1:]).stdout
    assert "docker push registry.example.com/ringserve/$image" in push

    # 2.-3. The install, rendered with the same flags: the default values pull exactly what was built.
    install = cmds[2]
    assert install[2:4] == ["rs", "deploy/helm/ringserve"]
    args = [a for a in install[4:] if a != "--create-namespace"]
    out = subprocess.run([str(helm), "template", "rs", str(REPO / "deploy/helm/ringserve"), *args,
                          "--kube-version", K8S_VERSION], capture_output=True, text=True, check=True, timeout=60)
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    images = {c["image"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images <= set(tags) and "registry.example.com/ringserve/ringserve-scheduler:0.1.0-cpu" in images
    assert by(docs, "PersistentVolumeClaim", "rs-ringserve-models")

    # 4. The check step names objects and ports of that render.
    assert cmds[3][2:6] == ["serve", "rollout", "status", "statefulset/rs-ringserve-replica"]
    by(docs, "StatefulSet", "rs-ringserve-replica")
    assert cmds[4] == ["helm", "test", "rs", "-n", "serve", "--logs"]
    by(docs, "Pod", "rs-ringserve-test-chat")  # the hook `helm test` runs
    for cmd, (local, remote) in ((cmds[5], ("8000", 80)), (cmds[6], ("30010", 30010))):
        assert cmd[2:4] == ["serve", "port-forward"]
        svc = by(docs, "Service", cmd[4].removeprefix("svc/"))
        assert cmd[5] == f"{local}:{remote}" and remote in [p["port"] for p in svc["spec"]["ports"]]
    assert cmds[8][2] == "127.0.0.1:30010"
