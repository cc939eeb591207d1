"""The chart's LoRA values: each adapter of config.scheduler.loraAdapters becomes a
--lora-modules flag of the scheduler, and loraVolume is mounted read-only at /adapters."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.helpers.helm import FULL, by, container, render


def test_adapters_and_their_volume_reach_the_scheduler(helm: Path, tmp_path: Path) -> None:
    values = tmp_path / "lora.yaml"
    values.write_text(yaml.safe_dump({"config": {"scheduler": {
        "loraAdapters": [{"name": "sql", "path": "/adapters/sql"}, {"name": "chat", "path": "/adapters/chat"}],
        "loraVolume": {"persistentVolumeClaim": {"claimName": "lora-adapters"}}, "maxLoras": 2}}}))
    spec = by(render(helm, None, "-f", str(values)), "StatefulSet", f"{FULL}-replica")["spec"]["template"]["spec"]
    scheduler = container(spec, "scheduler")
    args = scheduler["args"]
    assert [a for a in args if a.startswith(("--lora-modules", "--max-lora"))] == [
        "--max-loras=2", "--max-lora-rank=64", "--lora-modules=sql=/adapters/sql", "--lora-modules=chat=/adapters/chat"]
    assert {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True} in scheduler["volumeMounts"]
    assert {"name": "lora-adapters", "persistentVolumeClaim": {"claimName": "lora-adapters"}} in spec["volumes"]


def test_no_volume_by_default(helm: Path) -> None:
    spec = by(render(helm, None), "StatefulSet", f"{FULL}-replica")["spec"]["template"]["spec"]
    assert all(v["name"] != "lora-adapters" for v in spec["volumes"])
    assert not [a for a in container(spec, "scheduler")["args"] if a.startswith("--lora-modules")]
