"""``ringserve launch`` passes each service option it is given (the option table's ``launch``
options) to exactly the services that have it, and each service acts on it: one ring,
launched with options for every service."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import httpx
import pytest

from ringserve.launch import service_processes
from tests.helpers.ringstack import launched

GIVEN = {"--served-model-name": "tiny", "--context-length": "512", "--max-queued-requests": "7",
         "--tool-call-parser": "none", "--max-total-tokens": "4096"}
# Which services have each of them (ringserve/options: each service's table).
EXPECTED = {
    "gateway": {"--tool-call-parser": "none"},
    "tokenizer": {"--served-model-name": "tiny", "--context-length": "512"},
    "scheduler": {"--served-model-name": "tiny", "--context-length": "512", "--max-queued-requests": "7",
                  "--max-total-tokens": "4096"},
    "detokenizer": {"--served-model-name": "tiny"},
}


def _given(args: list[str]) -> dict[str, str]:
    """The GIVEN flags among a process's arguments, with their values."""
    return {a: b for a, b in pairwise(args) if a in GIVEN}


@pytest.mark.ring  # launches a ring of its own: its options differ from every shared ring's
def test_each_given_option_reaches_the_services_that_have_it(smollm2_dir: Path, tmp_path: Path) -> None:
    with launched(smollm2_dir, *(w for item in GIVEN.items() for w in item), log_path=tmp_path / "ring.log") as ring:
        args = {name: service_processes(ring.proc.pid, name)[0][1] for name in EXPECTED}
        assert {name: _given(a) for name, a in args.items()} == EXPECTED
        assert "--kv-cache-mem-fraction" not in args["scheduler"]  # a pool size was given

        # Each service acts on them: the tokenizer serves the name and bounds the context,
        # the scheduler sized its pool and labels its metrics with the name.
        models = httpx.get(f"{ring.base_url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        resp = httpx.post(f"{ring.base_url}/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": "word " * 600, "max_tokens": 1})
        assert resp.status_code == 400 and "maximum context length is 512 tokens" in resp.json()["error"]["message"]
        assert ring.scheduler_load().kv_total_tokens == 4096
        samples = ring.scrape("scheduler")
        assert any(dict(labels).get("model_name") == "tiny" for _, labels in samples)
