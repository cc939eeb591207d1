"""The gRPC service end to end on loopback: health, reflection, Stream -> Subscribe, GetLoad."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve import grpcutil
from ringserve.internal_auth import InternalAuth
from ringserve.v1 import common_pb2, detokenizer_pb2, detokenizer_pb2_grpc
from services.detokenizer.main import DetokenizerConfig, parse_args, start
from services.detokenizer.replay import StreamSpec, build_steps


def test_flags_parse_into_frozen_config(vocab_dirs, monkeypatch):
    monkeypatch.setenv("RINGSERVE_INTERNAL_TOKEN", "tok-a,tok-b")
    cfg = parse_args(["--model", str(vocab_dirs["smollm2"]), "--max-decode-states", "8"])
    assert cfg == DetokenizerConfig(model=vocab_dirs["smollm2"], max_decode_states=8,
                                    internal_auth=InternalAuth(("tok-a", "tok-b")))
    assert cfg.address == "127.0.0.1:30030"


async def test_stream_to_subscribers(vocab_dirs, tokenizers):
    tok = tokenizers["smollm2"]
    server, servicer = await start(DetokenizerConfig(model=vocab_dirs["smollm2"], port=0))
    try:
        channel = grpcutil.insecure_channel(f"127.0.0.1:{server.port}")
        health = health_pb2_grpc.HealthStub(channel)
        resp = await health.Check(health_pb2.HealthCheckRequest(service="ringserve.v1.Detokenizer"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        stub = detokenizer_pb2_grpc.DetokenizerStub(channel)
        sub1 = stub.Subscribe(detokenizer_pb2.SubscribeRequest(tokenizer_id="t1"))
        while "t1" not in servicer.subscribers:
            await asyncio.sleep(0.01)
        a = tok.encode("社区 👩‍💻 ok", add_special_tokens=False).ids
        specs = [StreamSpec("a", [[i] for i in a], tokenizer_id="t1"),
                 StreamSpec("b", [[i] for i in a], tokenizer_id="nobody")]
        steps = list(build_steps(specs))

        async def send():
            for s in steps:
                yield s

        events = [e async for e in stub.Stream(send())]
        assert events and events[0].load.instance_id
        texts = []
        for _ in steps:
            out = await asyncio.wait_for(sub1.read(), 5)
            assert list(out.rids) == ["a"]
            texts.append(out.texts[0])
        assert "".join(texts) == "社区 👩‍💻 ok"
        assert out.finish_reasons[0].type == common_pb2.FINISH_LENGTH
        load = await stub.GetLoad(common_pb2.Empty())
        assert load.decode_states == 0  # the unsubscribed rid's state was deleted too
        sub1.cancel()
        await channel.close()
    finally:
        await server.stop(0)
