"""The ring's internal credential without a model: where it comes from (flags, environment,
the launcher), the interceptor (once per call, so once per stream), and both ends of the
links against an in-process detokenizer: a wrong credential never counts as connected, and
a tokenizer whose own stale subscription is still registered retries until it is gone."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import grpc
import pytest

from ringserve import grpcutil
from ringserve.internal_auth import (
    MISSING,
    SKIP_FLAG,
    WRONG,
    InternalAuth,
    InternalAuthInterceptor,
    add_internal_auth_args,
    internal_auth_from_args,
)
from ringserve.launch import Launcher
from ringserve.launch import parse_args as launch_args
from ringserve.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc
from services.detokenizer.servicer import DetokenizerServicer
from services.scheduler.detok_link import DetokenizerLink as SchedulerSideLink
from services.tokenizer.links import DetokenizerLink
from tests.helpers.detokenizer_routing import RoutingManager, rows

DETOKENIZER = "ringserve.v1.Detokenizer"
TOKEN = "tok3n-for-the-tests"


def parse(argv: list[str], environ: dict[str, str], generate: bool = False) -> InternalAuth:
    parser = argparse.ArgumentParser()
    add_internal_auth_args(parser)
    return internal_auth_from_args(parser, parser.parse_args(argv), environ, generate)


def test_sources(tmp_path: Path) -> None:
    (tmp_path / "token").write_text(" t-new\nt-old \n")
    assert parse([], {"RINGSERVE_INTERNAL_TOKEN": "t-env"}).tokens == ("t-env",)
    auth = parse(["--internal-token-file", str(tmp_path / "token")], {"RINGSERVE_INTERNAL_TOKEN": "t-env"})
    assert auth.tokens == ("t-new", "t-old")  # the file wins over the environment
    assert auth.metadata() == (("ringserve-internal-token", "t-new"),)
    assert auth.env() == {"RINGSERVE_INTERNAL_TOKEN": "t-new,t-old"}
    assert repr(auth) == "InternalAuth(2 tokens)" and "t-new" not in repr(auth)
    assert parse([SKIP_FLAG], {"RINGSERVE_INTERNAL_TOKEN": "t-env"}) == InternalAuth()
    assert InternalAuth().metadata() == () and InternalAuth().env() == {} and InternalAuth().interceptors("x") == []
    generated = {parse([], {}, generate=True).tokens for _ in range(3)}
    assert len(generated) == 3 and all(len(t[0]) == 43 for t in generated)  # 32 random bytes, url-safe


@pytest.mark.parametrize("argv, environ, message", [
    ([], {}, "no internal credential: set $RINGSERVE_INTERNAL_TOKEN or --internal-token-file"),
    ([], {"RINGSERVE_INTERNAL_TOKEN": " ,\n"}, "$RINGSERVE_INTERNAL_TOKEN holds no token"),
    (["--internal-token-file", "EMPTY"], {}, "holds no token"),
    (["--internal-token-file", "MISSING"], {}, "No such file or directory"),
    ([], {"RINGSERVE_INTERNAL_TOKEN": "caf\u00e9"}, "holds a character that gRPC metadata cannot carry"),
    (["--internal-token-file", "EMPTY", SKIP_FLAG], {}, "contradict each other"),
])
def test_no_usable_token_is_an_error(tmp_path: Path, capsys, argv, environ, message) -> None:
    """A service run alone never starts open by accident, nor on an empty Secret."""
    (tmp_path / "EMPTY").write_text("\n")
    argv = [str(tmp_path / a) if a in ("EMPTY", "MISSING") else a for a in argv]
    with pytest.raises(SystemExit) as info:
        parse(argv, environ)
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and "caf" not in err


def test_launcher_hands_the_token_to_the_ring_only(monkeypatch) -> None:
    monkeypatch.delenv("RINGSERVE_INTERNAL_TOKEN")
    first, second = launch_args(["--model", "m"]), launch_args(["--model", "m"])
    assert first.internal_auth and first.internal_auth != second.internal_auth  # one per ring
    launcher = Launcher(first)
    (token,) = first.internal_auth.tokens
    for name in ("detokenizer", "scheduler-1", "tokenizer", "gateway"):
        cmd, env = launcher.command(name, ["--port", "1"])
        assert token not in " ".join(cmd) and SKIP_FLAG not in cmd
        assert env.get("RINGSERVE_INTERNAL_TOKEN") == (None if name == "gateway" else token), name
    monkeypatch.setenv("RINGSERVE_INTERNAL_TOKEN", "t-given")
    assert launch_args(["--model", "m"]).internal_auth.tokens == ("t-given",)
    open_ring = Launcher(launch_args(["--model", "m", SKIP_FLAG]))
    for name in ("detokenizer", "scheduler", "tokenizer"):
        cmd, env = open_ring.command(name, [])
        assert cmd[-1] == SKIP_FLAG and "RINGSERVE_INTERNAL_TOKEN" not in env


class CountingDetokenizer(detokenizer_pb2_grpc.DetokenizerServicer):
    def __init__(self) -> None:
        self.calls = 0
        self.messages = 0

    async def Stream(self, request_iterator, context):
        self.calls += 1
        async for _ in request_iterator:
            self.messages += 1
        yield detokenizer_pb2.DetokenizerEvent()

    async def GetLoad(self, request, context):
        self.calls += 1
        return common_pb2.LoadReport(instance_id="counted")


async def test_interceptor_checks_once_per_call_and_refuses_before_the_servicer() -> None:
    auth = InternalAuth((TOKEN, "t-old"))
    interceptor = InternalAuthInterceptor(auth, (DETOKENIZER,))
    checks = []
    refusal = interceptor.refusal
    interceptor.refusal = lambda value: checks.append(value) or refusal(value)
    servicer = CountingDetokenizer()
    server = await grpcutil.start_server("127.0.0.1:0", [
        (detokenizer_pb2_grpc.add_DetokenizerServicer_to_server, servicer, DETOKENIZER)], interceptors=[interceptor])
    try:
        async with grpcutil.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = detokenizer_pb2_grpc.DetokenizerStub(ch)
            batches = [detokenizer_pb2.BatchTokenIDOutput(rids=[f"r{i}"]) for i in range(500)]
            assert len([e async for e in stub.Stream(iter(batches), metadata=auth.metadata())]) == 1
            assert (servicer.calls, servicer.messages, len(checks)) == (1, 500, 1)  # 500 messages, one check
            assert (await stub.GetLoad(common_pb2.Empty(), metadata=(("ringserve-internal-token", "t-old"),))
                    ).instance_id == "counted"
            for metadata, message in (((), MISSING), ((("ringserve-internal-token", "t-ol"),), WRONG),
                                      ((("authorization", f"Bearer {TOKEN}"),), MISSING)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.GetLoad(common_pb2.Empty(), metadata=metadata)
                assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, message)
            assert servicer.calls == 2  # the refused calls never reached it
            assert len(checks) == 5
    finally:
        await server.stop(0)


@pytest.fixture
async def detokenizer():
    """A real DetokenizerServicer (routing only) behind the internal credential, in this loop."""
    servicer = DetokenizerServicer(RoutingManager(), "detok-test")
    server = await grpcutil.start_server(
        "127.0.0.1:0", [(detokenizer_pb2_grpc.add_DetokenizerServicer_to_server, servicer, DETOKENIZER)],
        interceptors=InternalAuth((TOKEN,)).interceptors(DETOKENIZER))
    yield servicer, f"127.0.0.1:{server.port}"
    await server.stop(0)


async def wait_until(predicate, timeout_s: float = 10.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout_s)


async def test_tokenizer_link_retries_while_its_stale_subscription_is_registered(detokenizer, caplog) -> None:
    servicer, target = detokenizer
    stale = servicer.subscribers.add("tok-x")  # its previous stream, not yet ended on this side
    batches, changes = [], []
    link = DetokenizerLink(target, "tok-x", batches.append, lambda _l, up: changes.append(up),
                           InternalAuth((TOKEN,)).metadata())
    caplog.set_level(logging.WARNING, "services.tokenizer.links")
    link.start()
    try:
        await wait_until(lambda: "ALREADY_EXISTS" in caplog.text)
        assert not link.up and changes == []
        assert caplog.text.count("already subscribed on another stream") == 1  # logged once, retried quietly
        servicer.subscribers.remove("tok-x", stale)  # the stale stream ends (keepalive)
        await wait_until(lambda: link.up)
        assert changes == [True] and servicer.subscribers.get("tok-x") is not stale
        servicer.route(rows("r1", "tok-x"))
        await wait_until(lambda: batches)
        assert list(batches[0].rids) == ["r1"]
    finally:
        await link.stop()


async def test_a_wrong_credential_never_counts_as_connected(detokenizer, caplog) -> None:
    servicer, target = detokenizer
    caplog.set_level(logging.WARNING)
    changes = []
    tok_link = DetokenizerLink(target, "tok-y", lambda _b: None, lambda _l, up: changes.append(up),
                               (("ringserve-internal-token", "wrong"),))
    sched_link = SchedulerSideLink(target, metadata=(("ringserve-internal-token", "wrong"),))
    tok_link.start()
    task = asyncio.create_task(sched_link.run())
    try:
        await wait_until(lambda: caplog.text.count(f"UNAUTHENTICATED: {WRONG}") == 2)
        await asyncio.sleep(0.3)
        assert changes == [] and not tok_link.up and "tok-y" not in servicer.subscribers
        assert not sched_link.connected.is_set() and sched_link.num_connects == 0 and servicer.streams == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await tok_link.stop()
