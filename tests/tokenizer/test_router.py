"""The replica router without a network: least outstanding work, then prefix affinity, then
rendezvous hashing; and the manager's use of it (one replica per request, aborts and link
losses per replica)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ringserve.v1 import common_pb2, detokenizer_pb2, tokenizer_pb2
from services.tokenizer.errors import RequestError, unavailable
from services.tokenizer.router import Router, block_keys, rendezvous_weight

A, B, C = "10.0.0.1:30020", "10.0.0.2:30020", "10.0.0.3:30020"
PREFIX = list(range(1000, 1064))  # 4 blocks of 16


def test_block_keys_are_chained_over_full_blocks():
    keys = block_keys(list(range(40)), 16)
    assert len(keys) == 2  # the 8-token tail is not a full block
    assert block_keys(list(range(16)), 16) == keys[:1]
    # The same second block after a different first block has another key: keys name prefixes.
    other = block_keys([7] * 16 + list(range(16, 32)), 16)
    assert other[1] != keys[1] and other[0] != keys[0]
    assert block_keys(list(range(15)), 16) == []


def test_least_outstanding_work_comes_first():
    router = Router()
    router.record(PREFIX, A)
    assert router.choose(PREFIX, {A: 2, B: 1, C: 3}) == B  # affinity does not beat load


def test_prefix_affinity_breaks_ties_by_the_longest_match():
    router = Router()
    router.record(PREFIX, A)
    router.record(PREFIX[:32] + [5] * 32, B)  # B served only the first two blocks since
    assert router.affinity(PREFIX) == {B: 2, A: 4}
    assert router.choose(PREFIX + [9, 9], {A: 0, B: 0, C: 0}) == A
    assert router.choose(PREFIX[:32] + [6] * 40, {A: 0, B: 0, C: 0}) == B
    assert router.choose(PREFIX, {B: 0, C: 0}) == B  # A is not eligible: the next-longest match


def test_without_affinity_the_rendezvous_hash_decides_the_same_in_every_instance():
    prompt = list(range(500, 580))
    head = Router().choose(prompt, {A: 0, B: 0, C: 0})
    # A fresh router (another tokenizer instance) agrees, whatever the order of the replicas.
    assert Router().choose(prompt, {C: 0, B: 0, A: 0}) == head
    weights = {name: rendezvous_weight(name, int.from_bytes(b"x" * 8, "little")) for name in (A, B, C)}
    assert len(set(weights.values())) == 3
    # Distinct prompts spread over the replicas when all are idle.
    chosen = {Router().choose([i] * 20, {A: 0, B: 0, C: 0}) for i in range(64)}
    assert chosen == {A, B, C}


def test_the_lru_is_bounded_and_forget_drops_a_replica():
    router = Router(block_size=4, max_entries=8)
    router.record(list(range(16)), A)  # 4 keys
    router.record(list(range(100, 116)), B)  # 4 more
    router.record(list(range(200, 208)), C)  # 2 more: A's 2 oldest go
    assert len(router) == 8
    assert router.affinity(list(range(16))) == {}  # its first block was evicted
    assert router.affinity(list(range(100, 116))) == {B: 4}
    assert router.forget(B) == 4 and router.affinity(list(range(100, 116))) == {}
    with pytest.raises(ValueError):
        router.choose([1, 2], {})


class FakeReplica:
    """A replica's dispatcher: records what it is sent; ``down`` refuses like a lost link."""

    def __init__(self, name: str):
        self.name = name
        self.up = True
        self.reqs: list = []
        self.aborts: list = []

    def send_req(self, req) -> None:
        if not self.up:
            raise unavailable(f"{self.name} down")
        self.reqs.append(req)

    def send_abort(self, abort) -> None:
        if not self.up:
            raise unavailable(f"{self.name} down")
        self.aborts.append(abort)


class FakeBalancer:
    """The ReplicaSet's pick over fake replicas (the real router decides)."""

    def __init__(self, replicas: list[FakeReplica]):
        self.replicas = replicas
        self.router = Router()

    def pick(self, input_ids, outstanding):
        eligible = {r.name: r for r in self.replicas if r.up}
        if not eligible:
            raise unavailable("no model replica is connected")
        name = self.router.choose(input_ids, {n: outstanding.get(r, 0) for n, r in eligible.items()})
        self.router.record(input_ids, name)
        return eligible[name]


def chat_req(rid: str, n: int = 1, content: str = "Hi") -> tokenizer_pb2.GenerateReqInput:
    req = tokenizer_pb2.GenerateReqInput(rid=rid, stream=True, sampling_params=common_pb2.SamplingParams(n=n))
    req.chat.messages.add(role="user", content=content)
    return req


def abort_row(rid: str) -> detokenizer_pb2.BatchStrOutput:
    return detokenizer_pb2.BatchStrOutput(
        rids=[rid], texts=[""], new_token_counts=[0], prompt_tokens=[0], completion_tokens=[0], cached_tokens=[0],
        finish_reasons=[common_pb2.FinishReason(type=common_pb2.FINISH_ABORT, status="CANCELLED")],
    )


@pytest.fixture
def two(manager):
    replicas = [FakeReplica(A), FakeReplica(B)]
    manager.balancer = FakeBalancer(replicas)
    return manager, replicas


async def test_requests_spread_and_choices_of_one_request_share_a_replica(two):
    manager, (ra, rb) = two
    gens = [manager.generate(chat_req(f"s{i}", n=2, content=f"Question {i}")) for i in range(4)]
    tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
    await asyncio.sleep(0.01)
    assert len(ra.reqs) == len(rb.reqs) == 4  # least outstanding work: 2 requests of 2 choices each
    for r in (ra, rb):
        parents = {req.rid.rsplit("-", 1)[0] for req in r.reqs}
        assert sorted(req.rid for req in r.reqs) == sorted(f"{p}-{i}" for p in parents for i in (0, 1))
    assert dict(manager.outstanding) == {ra: 4, rb: 4}
    # Aborts go to the replica that holds the rid.
    on_a = ra.reqs[0].rid.rsplit("-", 1)[0]
    assert manager.abort(on_a)
    assert sorted(a.rid for a in ra.aborts) == [f"{on_a}-0", f"{on_a}-1"] and rb.aborts == []
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for g in gens:
        await g.aclose()
    for req in ra.reqs + rb.reqs:
        manager.handle_batch(abort_row(req.rid))
    assert manager.load().req_states == 0 and dict(manager.outstanding) == {}


async def test_losing_one_replica_fails_only_its_requests(two):
    manager, (ra, rb) = two
    gens = [manager.generate(chat_req(f"l{i}", content=f"Question {i}")) for i in range(2)]
    tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
    await asyncio.sleep(0.01)
    assert len(ra.reqs) == len(rb.reqs) == 1
    on_a = ra.reqs[0].rid
    ra.up = False
    assert manager.fail_all(unavailable(f"lost the connection to the scheduler at {A}"), False, replica=ra) == 1
    done, pending = await asyncio.wait(tasks, timeout=1)
    [failed] = done
    with pytest.raises(RequestError) as info:
        failed.result()
    assert (info.value.status, info.value.message) == (
        grpc.StatusCode.UNAVAILABLE, f"lost the connection to the scheduler at {A}")
    assert tasks.index(failed) == int(on_a[1:])  # the request that went to the lost replica
    assert len(pending) == 1 and manager.load().req_states == 1  # the other replica's request goes on
    # A new request goes to the replica that is up, even with the same prompt.
    again = manager.generate(chat_req("l9", content=f"Question {on_a[1:]}"))
    task = asyncio.ensure_future(again.__anext__())
    await asyncio.sleep(0.01)
    assert [r.rid for r in rb.reqs] == [rb.reqs[0].rid, "l9"]
    rb.up = False
    with pytest.raises(RequestError) as info:
        await manager.generate(chat_req("l10")).__anext__()
    assert info.value.status == grpc.StatusCode.UNAVAILABLE
    for t in (*pending, task):
        t.cancel()
    await asyncio.gather(*pending, task, return_exceptions=True)
