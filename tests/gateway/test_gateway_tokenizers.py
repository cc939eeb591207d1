"""The gateway over several tokenizer instances: target resolution for /get_load, the merged
/get_load document, and round_robin over an ``ipv4:`` target of two real gRPC servers."""

from __future__ import annotations

from itertools import pairwise

import grpc
import pytest

from ringserve import grpcutil
from ringserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.gateway.app import cluster_load_json
from services.gateway.backend import ROUND_ROBIN, resolve_target
from services.gateway.errors import GatewayError


async def test_resolve_target_names_every_address():
    assert await resolve_target("127.0.0.1:30010") == ["127.0.0.1:30010"]
    assert await resolve_target("unix:/tmp/tok.sock") == ["unix:/tmp/tok.sock"]
    assert await resolve_target("ipv4:127.0.0.1:1,127.0.0.1:2") == ["127.0.0.1:1", "127.0.0.1:2"]
    assert await resolve_target("dns:///127.0.0.1:30010") == ["127.0.0.1:30010"]
    assert await resolve_target("dns:127.0.0.1:7") == ["127.0.0.1:7"]
    with pytest.raises(GatewayError) as info:
        await resolve_target("dns:///no-such-host.invalid:30010")
    assert info.value.status == 503


def test_cluster_load_json_dedupes_shared_replicas():
    def report(name: str, **fields) -> common_pb2.LoadReport:
        return common_pb2.LoadReport(instance_id=name, **fields)

    shared = dict(schedulers=[report("scheduler-0", num_running_reqs=3), report("scheduler-1", kv_used_tokens=9)],
                  detokenizers=[report("detokenizer@a:1", decode_states=3), report("detokenizer@b:1")])
    loads = [tokenizer_pb2.ClusterLoad(tokenizer=report("tok-a", req_states=2), **shared),
             tokenizer_pb2.ClusterLoad(tokenizer=report("tok-b", req_states=1), **shared)]
    got = cluster_load_json(loads)
    assert [(t["instance_id"], t["req_states"]) for t in got["tokenizer"]] == [("tok-a", 2), ("tok-b", 1)]
    assert [(s["instance_id"], s["num_running_reqs"], s["kv_used_tokens"]) for s in got["scheduler"]] == [
        ("scheduler-0", 3, 0), ("scheduler-1", 0, 9)]
    assert [(d["instance_id"], d["decode_states"]) for d in got["detokenizer"]] == [
        ("detokenizer@a:1", 3), ("detokenizer@b:1", 0)]


class Named(tokenizer_pb2_grpc.TokenizerServicer):
    def __init__(self, name: str):
        self.name = name

    async def GetLoad(self, request, context):
        return common_pb2.LoadReport(instance_id=self.name)


async def test_round_robin_spreads_calls_over_an_ipv4_target():
    servers = []
    for name in ("tok-a", "tok-b"):
        server = grpc.aio.server()
        tokenizer_pb2_grpc.add_TokenizerServicer_to_server(Named(name), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append((server, port))
    target = "ipv4:" + ",".join(f"127.0.0.1:{port}" for _, port in servers)
    try:
        async with grpcutil.insecure_channel(target, extra_options=(ROUND_ROBIN,)) as channel:
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            seen = set()
            while len(seen) < 2:  # channel_ready means one subchannel is; round_robin adds the other once up
                seen.add((await stub.GetLoad(common_pb2.Empty(), timeout=5)).instance_id)
            names = [(await stub.GetLoad(common_pb2.Empty(), timeout=5)).instance_id for _ in range(8)]
        async with grpcutil.insecure_channel(target) as channel:  # pick_first, for contrast
            stub = tokenizer_pb2_grpc.TokenizerStub(channel)
            first = {(await stub.GetLoad(common_pb2.Empty(), timeout=5)).instance_id for _ in range(8)}
    finally:
        for server, _ in servers:
            await server.stop(0)
    assert names.count("tok-a") == names.count("tok-b") == 4
    assert all(a != b for a, b in pairwise(names))  # strictly alternating
    assert len(first) == 1
