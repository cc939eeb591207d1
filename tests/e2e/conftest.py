"""Rings shared by several modules, each launched once per session: a ring behind API keys
with small limits; a bf16 ring with mutual TLS between its services. (The default ring,
``stack`` in tests/conftest.py, serves the structured-output, tool and reasoning cases: its
tokenizer renders SmolLM2's chats with the shipped ChatML tools template.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import trustme

from tests.helpers.ring_requests import API_KEYS, bearer
from tests.helpers.ringstack import launched
from tests.helpers.tiers import ring_fixture
from tests.helpers.tls import write_pems


@ring_fixture(scope="session")
def keyed_ring(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2 in fp32 behind two API keys, one from ``--api-key``, the other from
    ``--api-key-file`` (``API_KEYS``: a rotation, both valid), with ``--log-requests``, two
    request slots, a queue of one (``--max-queued-requests 1``) and a 4096-token KV pool; the
    ring's calls present the first key, its output goes to ``ring.log()``; SSE keepalive comments
    every second. For test_api_keys.py, test_reliability_overload.py and test_sse_keepalive_ring.py;
    the last test of a session (tests/e2e/test_launcher_orphans.py) SIGKILLs its launcher."""
    directory = tmp_path_factory.mktemp("keyed")
    keyfile = directory / "keys"
    keyfile.write_text(f"{API_KEYS[1]}\n")
    with launched(smollm2_dir, "--api-key", API_KEYS[0], "--api-key-file", str(keyfile), "--log-requests",
                  "--max-running-requests", "2", "--max-queued-requests", "1", "--max-total-tokens", "4096",
                  "--sse-keepalive-s", "1", log_path=directory / "ring.log") as ring:
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
