"""TLS: a ring launched with mutual TLS between every gRPC service (``tls_ring``,
tests/e2e/conftest.py, in bf16; test_deterministic_ring.py shares it).

Certificates come from a throwaway CA (trustme): one certificate for 127.0.0.1 serves as
every service's server certificate and as the client certificate of every channel. The
launcher's health checks, the gateway's channel to the tokenizer and the tokenizer's
channels to the scheduler and the detokenizer all go through TLS, so a chat answer proves
each hop; the tokenizer then refuses a plaintext client, a TLS client with no client
certificate and one whose certificate another CA signed.
"""

from __future__ import annotations

import subprocess
import sys

import grpc
import httpx
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve import grpcutil
from ringserve.v1 import common_pb2, tokenizer_pb2_grpc
from tests.helpers.ring_requests import chat
from tests.helpers.tls import write_pems


@pytest.fixture
def ring(tls_ring):
    return tls_ring


def model_info(channel: grpc.Channel) -> str:
    return tokenizer_pb2_grpc.TokenizerStub(channel).GetModelInfo(common_pb2.Empty(), timeout=10).served_model_name


def test_mutual_tls_ring_serves_a_chat(ring, pems):
    # Japan, not France: in bf16 SmolLM2 answers Tokyo, as in fp32, but does not answer Paris.
    ask = [{"role": "user", "content": "What is the capital of Japan?"}]
    resp = httpx.post(f"{ring.base_url}/v1/chat/completions", json=chat(ring, ask, max_tokens=16), timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == "The capital of Japan is Tokyo."
    creds = grpc.ssl_channel_credentials(pems["ca"].read_bytes(), pems["key"].read_bytes(),
                                         pems["cert"].read_bytes())
    with grpc.secure_channel(ring.tokenizer, creds) as ch:
        assert model_info(ch) == ring.model_name
        load = tokenizer_pb2_grpc.TokenizerStub(ch).GetLoad(common_pb2.Empty(), timeout=10)
        assert load.req_states == 0


def test_plaintext_client_is_refused(ring):
    for address in (ring.tokenizer, ring.scheduler, ring.detokenizer):
        with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as info:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, address


def test_client_without_a_client_certificate_is_refused(ring, pems):
    with grpc.secure_channel(ring.tokenizer, grpc.ssl_channel_credentials(pems["ca"].read_bytes())) as ch:
        with pytest.raises(grpc.RpcError) as info:
            model_info(ch)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_certificate_of_another_ca_is_refused(ring, pems, tmp_path):
    other = write_pems(trustme.CA(), tmp_path)
    creds = grpc.ssl_channel_credentials(pems["ca"].read_bytes(), other["key"].read_bytes(),
                                         other["cert"].read_bytes())
    with grpc.secure_channel(ring.tokenizer, creds) as ch, pytest.raises(grpc.RpcError) as info:
        model_info(ch)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_ringserve_health_probe_speaks_mutual_tls(ring, pems):
    """The Helm chart's probe under grpcTls: `ringserve health localhost:PORT --tls-*`."""
    port = ring.tokenizer.rsplit(":", 1)[1]
    tls = ["--tls-cert-file", str(pems["cert"]), "--tls-key-file", str(pems["key"]), "--tls-ca-file", str(pems["ca"])]
    probe = [sys.executable, "-m", "ringserve.cli", "health", f"localhost:{port}"]
    assert subprocess.run([*probe, *tls], timeout=60).returncode == 0
    assert subprocess.run(probe, timeout=60).returncode == 1


async def test_server_side_tls_without_client_certificates(pems):
    """cert + key and no CA: the server speaks TLS but asks for no client certificate; a
    channel given only the CA (to verify the server) is served, a plaintext one is not."""
    server = await grpcutil.start_server(
        "127.0.0.1:0", [], grpcutil.Transport(tls_cert_file=pems["cert"], tls_key_file=pems["key"]))
    await server.set_serving(True)
    target = f"127.0.0.1:{server.port}"
    try:
        async with grpcutil.channel(target, grpcutil.Transport(tls_ca_file=pems["ca"])) as ch:
            assert await grpcutil.wait_serving(ch)
        async with grpcutil.insecure_channel(target) as ch:
            assert not await grpcutil.wait_serving(ch, timeout_s=2)
    finally:
        await server.stop(0)
