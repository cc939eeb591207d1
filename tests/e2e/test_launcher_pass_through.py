"""``ringserve launch`` passes each service option it is given (the option table's ``launch``
options) to exactly the services that have it, and each service acts on it: the session's
priority ring (``priority_ring``, tests/e2e/conftest.py), launched with ``PASS_THROUGH``, an
option for every service."""

from __future__ import annotations

from itertools import pairwise

import httpx

from ringserve.launch import service_processes
from tests.helpers.ring_requests import PASS_THROUGH, PRIORITY_KV_TOKENS

GIVEN = PASS_THROUGH
# Which services have each of them (ringserve/options: each service's table).
EXPECTED = {
    "gateway": {"--tool-call-parser": "none"},
    "tokenizer": {"--served-model-name": "tiny", "--context-length": "512"},
    "scheduler": {"--served-model-name": "tiny", "--context-length": "512", "--max-queued-requests": "7",
                  "--max-total-tokens": str(PRIORITY_KV_TOKENS)},
    "detokenizer": {"--served-model-name": "tiny"},
}


def _given(args: list[str]) -> dict[str, str]:
    """The GIVEN flags among a process's arguments, with their values."""
    return {a: b for a, b in pairwise(args) if a in GIVEN}


def test_each_given_option_reaches_the_services_that_have_it(priority_ring) -> None:
    ring = priority_ring
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
    assert ring.scheduler_load().kv_total_tokens == PRIORITY_KV_TOKENS
    samples = ring.scrape("scheduler")
    assert any(dict(labels).get("model_name") == "tiny" for _, labels in samples)
