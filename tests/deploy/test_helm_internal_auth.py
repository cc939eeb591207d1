"""The chart's internal credential (internalAuth.*): a Secret generated at install and kept on
upgrade, or an existing one, read from the environment by the tokenizer, the scheduler and
the detokenizer (never on a command line), and the loud opt-out when disabled."""

from __future__ import annotations

import base64
import shutil
import string
import subprocess
import tempfile
from pathlib import Path

import yaml

from tests.helpers.helm import CHART, FULL, RELEASE, by, container, render

SKIP = "--insecure-skip-internal-auth"


def ring_containers(docs: list[dict]) -> dict[str, dict]:
    tok = by(docs, "Deployment", f"{FULL}-tokenizer")["spec"]["template"]["spec"]
    replica = by(docs, "StatefulSet", f"{FULL}-replica")["spec"]["template"]["spec"]
    return {"tokenizer": container(tok, "tokenizer"), "scheduler": container(replica, "scheduler"),
            "detokenizer": container(replica, "detokenizer")}


def token_env(c: dict) -> dict | None:
    return next((e for e in c.get("env", []) if e["name"] == "RINGSERVE_INTERNAL_TOKEN"), None)


def test_generated_by_default_and_given_to_every_ring_service(helm: Path) -> None:
    docs = render(helm, "cpu-single")
    secret = by(docs, "Secret", f"{FULL}-internal-token")
    token = base64.b64decode(secret["data"]["internal-token"]).decode()
    assert len(token) == 48 and set(token) <= set(string.ascii_letters + string.digits)
    ref = {"secretKeyRef": {"name": f"{FULL}-internal-token", "key": "internal-token"}}
    for name, c in ring_containers(docs).items():
        assert token_env(c) == {"name": "RINGSERVE_INTERNAL_TOKEN", "valueFrom": ref}, name
        assert SKIP not in c["args"] and not any("internal-token" in a for a in c["args"]), name
    gateway = container(by(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"], "gateway")
    assert token_env(gateway) is None  # it calls only the tokenizers' public API
    for d in docs:
        if d["kind"] != "Secret":
            assert token not in yaml.safe_dump(d)
    # Every render without a cluster draws a new token; an install keeps the one it finds (below).
    again = by(render(helm, "cpu-single"), "Secret", f"{FULL}-internal-token")["data"]["internal-token"]
    assert again != secret["data"]["internal-token"]


def test_an_upgrade_keeps_the_token(helm: Path) -> None:
    """`lookup` needs a cluster, so a copy of the chart answers it with the Secret an earlier
    install made: the rendered token must be that one, not a new one."""
    kept = base64.b64encode(b"kept-token-from-the-first-install").decode()
    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / "ringserve"
        shutil.copytree(CHART, chart)
        template = chart / "templates" / "internal-secret.yaml"
        source = template.read_text()
        assert 'lookup "v1" "Secret" .Release.Namespace $name' in source
        template.write_text(source.replace('lookup "v1" "Secret" .Release.Namespace $name',
                                           f'dict "data" (dict "internal-token" "{kept}")'))
        out = subprocess.run([str(helm), "template", RELEASE, str(chart), "--show-only",
                              "templates/internal-secret.yaml"], check=True, capture_output=True, text=True, timeout=60)
    assert yaml.safe_load(out.stdout)["data"] == {"internal-token": kept}


def test_existing_secret_and_opt_out(helm: Path) -> None:
    docs = render(helm, "cpu-single", "--set", "internalAuth.existingSecret=ring-token",
                  "--set", "internalAuth.secretKey=token")
    assert not any(d["kind"] == "Secret" for d in docs)
    for name, c in ring_containers(docs).items():
        assert token_env(c)["valueFrom"] == {"secretKeyRef": {"name": "ring-token", "key": "token"}}, name

    docs = render(helm, "cpu-single", "--set", "internalAuth.enabled=false")
    assert not any(d["kind"] == "Secret" for d in docs)
    for name, c in ring_containers(docs).items():
        assert token_env(c) is None and c["args"].count(SKIP) == 1, name


def test_schema_checks_internal_auth(helm: Path) -> None:
    for bad, word in (("internalAuth.enabled=maybe", "enabled"), ("internalAuth.secretKey=", "secretKey"),
                      ("internalAuth.value=x", "value")):
        out = subprocess.run([str(helm), "template", RELEASE, str(CHART), "--set", bad],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and word in out.stderr, (bad, out.stderr)
