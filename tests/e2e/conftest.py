"""Rings shared by several modules, each launched once per session: a ring behind API keys
with small limits, exporting its spans to a receiver in this process; a bf16 ring with mutual
TLS between its services; a ring under the priority policy with a tiny KV pool that also
carries an option for every service. (The default ring, ``stack`` in tests/conftest.py, serves
the structured-output, tool and reasoning cases: its tokenizer renders SmolLM2's chats with the
shipped ChatML tools template.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from tests.helpers.otlp import OtlpReceiver, otlp_receiver
from tests.helpers.ring_requests import API_KEYS, PASS_THROUGH, bearer
from tests.helpers.ringstack import launched
from tests.helpers.tiers import ring_fixture
from tests.helpers.tls import write_pems


@pytest.fixture(scope="session")
def otlp() -> Iterator[tuple[str, OtlpReceiver]]:
    """An OTLP/gRPC span receiver for the session (tests/helpers/otlp.py): (its address, it)."""
    with otlp_receiver() as served:
        yield served


@ring_fixture(scope="session")
def keyed_ring(smollm2_dir: Path, otlp: tuple[str, OtlpReceiver], tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2 in fp32 behind two API keys, one from ``--api-key``, the other from
    ``--api-key-file`` (``API_KEYS``: a rotation, both valid), with ``--log-requests``, two
    request slots, a queue of one (``--max-queued-requests 1``) and a 4096-token KV pool; the
    ring's calls present the first key, its output goes to ``ring.log()``; SSE keepalive comments
    every second; its spans go to ``otlp``'s receiver (``--otlp-traces-endpoint``), batch-exported
    every 50 ms so that they arrive at once. For test_api_keys.py, test_reliability_overload.py,
    test_sse_keepalive_ring.py and test_tracing.py (the tests that need --log-requests or spans
    share this ring rather than launch one each); the last test of a session
    (tests/e2e/test_launcher_orphans.py) SIGKILLs its launcher."""
    directory = tmp_path_factory.mktemp("keyed")
    keyfile = directory / "keys"
    keyfile.write_text(f"{API_KEYS[1]}\n")
    with launched(smollm2_dir, "--api-key", API_KEYS[0], "--api-key-file", str(keyfile), "--log-requests",
                  "--max-running-requests", "2", "--max-queued-requests", "1", "--max-total-tokens", "4096",
                  "--sse-keepalive-s", "1", "--otlp-traces-endpoint", otlp[0],
                  # ms between batch exports (the SDK's default: 5000)
                  env={"OTEL_BSP_SCHEDULE_DELAY": "50"}, log_path=directory / "ring.log") as ring:
        ring.grpc_metadata = bearer(API_KEYS[0])
        ring.http_headers = {"Authorization": f"Bearer {API_KEYS[0]}"}
        yield ring


@pytest.fixture(scope="session")
def pems(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A throwaway CA's certificate for 127.0.0.1 (tests/helpers/tls.py)."""
    return write_pems(trustme.CA(), tmp_path_factory.mktemp("tls"))


@ring_fixture(scope="session")
def tls_ring(smollm2_dir: Path, pems: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2 in bf16, the default dtype (deterministic inference is on by default there), with
    mutual TLS between every gRPC service (one certificate from ``pems`` for all of them); its
    output goes to ``ring.log()``. For test_reliability_tls.py and test_deterministic_ring.py."""
    with launched(smollm2_dir, "--dtype", "bfloat16", "--tls-cert-file", str(pems["cert"]),
                  "--tls-key-file", str(pems["key"]), "--tls-ca-file", str(pems["ca"]),
                  log_path=tmp_path_factory.mktemp("tls-ring") / "ring.log") as ring:
        yield ring


@ring_fixture(scope="session")
def priority_ring(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2 in fp32 under ``--schedule-policy priority`` with two request slots and a 128-token
    KV pool (no other ring runs that policy), plus ``PASS_THROUGH``: a served name, a 512-token
    context, a queue of seven and a tool-call parser, one option for each service, which
    test_launcher_pass_through.py follows to the services (none of them bears on what
    test_priority_ring.py measures: its prompts and outputs stay under 100 tokens, at most five
    requests wait, and it names no model and no tools). Its output goes to ``ring.log()``."""
    flags = (w for item in PASS_THROUGH.items() for w in item)
    with launched(smollm2_dir, "--schedule-policy", "priority", "--max-running-requests", "2", *flags,
                  log_path=tmp_path_factory.mktemp("priority-ring") / "ring.log") as ring:
        ring.model_name = PASS_THROUGH["--served-model-name"]
        yield ring
