"""Without a model: where API keys come from, how they are checked, and the typed
client's key and TLS options against an in-process Tokenizer server that counts the calls
its servicer saw (a refused call must never reach it)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve import grpcutil
from ringserve.apikeys import MISSING, WRONG, ApiKeyInterceptor, ApiKeys, add_api_key_args, api_keys_from_args
from ringserve.client import AsyncRingserveClient, RingserveClient, channel_credentials
from ringserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.tokenizer import main as tokenizer_main
from services.tokenizer.servicer import SERVICE_NAME
from tests.helpers.tls import write_pems


def parse(argv: list[str], environ: dict[str, str] | None = None) -> ApiKeys:
    parser = argparse.ArgumentParser()
    add_api_key_args(parser, "the test")
    return api_keys_from_args(parser, parser.parse_args(argv), environ or {})


def test_keys_from_flag_file_and_environment(tmp_path: Path) -> None:
    keyfile = tmp_path / "keys"
    keyfile.write_text("sk-file-1\n\nsk-file-2\n")
    keys = parse(["--api-key", "sk-flag", "--api-key", "sk-a,sk-b", "--api-key-file", str(keyfile)],
                 {"RINGSERVE_API_KEY": " sk-env ,sk-flag\n"})
    assert keys.keys == ("sk-flag", "sk-a", "sk-b", "sk-file-1", "sk-file-2", "sk-env")
    assert parse([]).keys == () and not parse([])
    assert repr(keys) == "ApiKeys(6 keys)" and "sk-" not in str(keys) and "sk-" not in repr(ApiKeys(("sk-x",)))
    assert keys.metadata() == (("authorization", "Bearer sk-flag"),)
    assert keys.env() == {"RINGSERVE_API_KEY": "sk-flag,sk-a,sk-b,sk-file-1,sk-file-2,sk-env"}


@pytest.mark.parametrize("argv, environ, message", [
    (["--api-key", ""], {}, "--api-key is empty"),
    (["--api-key-file", "EMPTY"], {}, "holds no key"),
    (["--api-key-file", "MISSING"], {}, "No such file or directory"),
    ([], {"RINGSERVE_API_KEY": " ,\n"}, "$RINGSERVE_API_KEY is set but holds no key"),
])
def test_a_source_without_a_key_is_an_error(tmp_path: Path, capsys, argv, environ, message) -> None:
    """An empty Secret or a typo must not silently turn authentication off."""
    (tmp_path / "EMPTY").write_text("\n \n")
    argv = [str(tmp_path / a) if a in ("EMPTY", "MISSING") else a for a in argv]
    with pytest.raises(SystemExit) as info:
        parse(argv, environ)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_accepts() -> None:
    keys = ApiKeys(("sk-new", "sk-old"))
    assert keys.accepts("Bearer sk-new") and keys.accepts("Bearer sk-old") and keys.accepts("bearer sk-old")
    for bad in (None, "", "sk-new", "Bearer", "Bearer sk-ne", "Bearer sk-new2", "Basic sk-new", "Bearer sk-new,sk-old"):
        assert not keys.accepts(bad), bad
    assert ApiKeys().accepts(None)  # no keys: nothing to check


def test_tokenizer_flags(tmp_path: Path, smollm2_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("RINGSERVE_API_KEY", "sk-env")
    config = tokenizer_main.parse_args(["--model", str(smollm2_dir), "--api-key", "sk-flag"])
    assert config.api_keys.keys == ("sk-flag", "sk-env")
    assert "sk-" not in repr(config)
    monkeypatch.delenv("RINGSERVE_API_KEY")
    assert not tokenizer_main.parse_args(["--model", str(smollm2_dir)]).api_keys


class CountingTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Answers three RPCs and counts every call that reached it."""

    def __init__(self) -> None:
        self.calls = 0

    async def GetModelInfo(self, request, context):
        self.calls += 1
        return tokenizer_pb2.ModelInfo(served_model_name="counting")

    async def Abort(self, request, context):
        self.calls += 1
        return tokenizer_pb2.AbortResponse(found=request.rid == "known")

    async def Generate(self, request, context):
        self.calls += 1
        for word in ("Hello", " there"):
            yield tokenizer_pb2.GenerateOutput(rid=request.rid, text=word)


@pytest.fixture(scope="module")
def pems(tmp_path_factory) -> dict[str, Path]:
    return write_pems(trustme.CA(), tmp_path_factory.mktemp("tls"))


async def serve(transport: grpcutil.Transport) -> tuple[CountingTokenizer, grpcutil.ServingServer]:
    servicer = CountingTokenizer()
    server = await grpcutil.start_server(
        "127.0.0.1:0", [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, servicer, SERVICE_NAME)], transport,
        interceptors=[ApiKeyInterceptor(ApiKeys(("sk-new", "sk-old")), (SERVICE_NAME,))])
    await server.set_serving(True)
    return servicer, server


def sync_calls(target: str, **connection) -> list[object]:
    """The three RPCs through the blocking client (run in a thread: the server shares the test's loop)."""
    with RingserveClient(target, **connection) as client:
        return [client.model_info(timeout_s=10).served_model_name, client.abort("known", timeout_s=10),
                "".join(c.text for c in client.complete("hi", timeout_s=10))]


def sync_refusals(target: str, **connection) -> list[tuple[grpc.StatusCode, str]]:
    """The status of each of the three RPCs that fail, through the blocking client."""
    with RingserveClient(target, **connection) as client:
        return [refused(call) for call in (lambda: client.model_info(timeout_s=10),
                                           lambda: client.abort("known", timeout_s=10),
                                           lambda: list(client.complete("hi", timeout_s=10)))]


async def async_calls(client: AsyncRingserveClient) -> list[object]:
    return [(await client.model_info(timeout_s=10)).served_model_name, await client.abort("known", timeout_s=10),
            "".join([c.text async for c in client.complete("hi", timeout_s=10)])]


def refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
async def test_client_key_and_tls_options(pems, mutual: bool) -> None:
    server_tls = grpcutil.Transport(tls_cert_file=pems["cert"], tls_key_file=pems["key"],
                                    tls_ca_file=pems["ca"] if mutual else None)
    servicer, server = await serve(server_tls)
    target = f"127.0.0.1:{server.port}"
    tls = {"ca_file": pems["ca"], **({"cert_file": pems["cert"], "key_file": pems["key"]} if mutual else {})}
    try:
        for key in ("sk-new", "sk-old"):  # both keys of a rotation work, sync and async
            assert await asyncio.to_thread(sync_calls, target, api_key=key, **tls) == ["counting", True, "Hello there"]
            async with AsyncRingserveClient(target, api_key=key, **tls) as aclient:
                assert await async_calls(aclient) == ["counting", True, "Hello there"]
        assert servicer.calls == 12

        for key, message in ((None, MISSING), ("sk-older", WRONG)):
            assert await asyncio.to_thread(sync_refusals, target, api_key=key, **tls) == [
                (grpc.StatusCode.UNAUTHENTICATED, message)] * 3
            async with AsyncRingserveClient(target, api_key=key, **tls) as aclient:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    [c async for c in aclient.complete("hi", timeout_s=10)]
                assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, message)
        assert servicer.calls == 12  # no refused call reached the servicer

        # Health stays open; a plaintext client never gets through the TLS handshake.
        async with grpcutil.channel(target, grpcutil.Transport(
                tls_ca_file=pems["ca"], tls_cert_file=pems["cert"] if mutual else None,
                tls_key_file=pems["key"] if mutual else None)) as ch:
            assert await grpcutil.wait_serving(ch, SERVICE_NAME)
        plaintext = await asyncio.to_thread(sync_refusals, target, api_key="sk-new")
        assert [code for code, _ in plaintext] == [grpc.StatusCode.UNAVAILABLE] * 3
    finally:
        await server.stop(0)


async def test_plaintext_health_open_and_unknown_method() -> None:
    servicer, server = await serve(grpcutil.Transport())
    target = f"127.0.0.1:{server.port}"
    try:
        async with grpcutil.insecure_channel(target) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                              timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            # Not implemented by this servicer: the key check comes first all the same.
            stub = tokenizer_pb2_grpc.TokenizerStub(ch)
            for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED),
                                   ((("authorization", "Bearer sk-new"),), grpc.StatusCode.UNIMPLEMENTED)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.GetLoad(common_pb2.Empty(), timeout=10, metadata=metadata)
                assert info.value.code() == code
        assert servicer.calls == 0
    finally:
        await server.stop(0)


def test_channel_credentials_options(pems) -> None:
    assert channel_credentials() is None
    assert isinstance(channel_credentials(tls=True), grpc.ChannelCredentials)
    assert isinstance(channel_credentials(ca_file=pems["ca"]), grpc.ChannelCredentials)
    with pytest.raises(ValueError, match="cert_file and key_file go together"):
        channel_credentials(cert_file=pems["cert"])
