"""The tokenizer's prefill/decode pairs (services/tokenizer/disagg_pair.py) over fake replicas:
which pair a request gets, the order and shape of what each member receives, aborts."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ringserve.v1 import common_pb2, detokenizer_pb2, disagg_pb2, scheduler_pb2, tokenizer_pb2
from services.tokenizer.disagg_pair import Pair
from services.tokenizer.errors import RequestError, unavailable
from services.tokenizer.replicas import ReplicaAddress, ReplicaSet


class FakeLink:
    def __init__(self, mode: str):
        self.last_load = common_pb2.LoadReport(disaggregation_mode=mode)


class FakeReplica:
    """What ReplicaSet and Pair read of a Replica; records what it is sent."""

    def __init__(self, name: str, mode: str, up: bool = True):
        self.name, self.up = name, up
        self.address = ReplicaAddress(name, name + "-detok")
        self.scheduler = FakeLink(mode)
        self.schedule_policy = "fcfs"
        self.sent: list[object] = []

    def send_req(self, req: scheduler_pb2.TokenizedGenerateReqInput) -> None:
        if not self.up:
            raise unavailable(f"the scheduler at {self.name} is not connected")
        self.sent.append(req)

    def send_abort(self, abort: scheduler_pb2.AbortReq) -> None:
        if not self.up:
            raise unavailable(f"the scheduler at {self.name} is not connected")
        self.sent.append(abort)


def _set(*replicas: FakeReplica) -> ReplicaSet:
    return ReplicaSet(replicas)  # type: ignore[arg-type]


def test_a_cluster_with_both_roles_gets_a_pair_by_least_load_with_prefix_affinity_on_the_prefill_side():
    p0, p1, d0, d1 = (FakeReplica("p0", "prefill"), FakeReplica("p1", "prefill"), FakeReplica("d0", "decode"),
                      FakeReplica("d1", "decode"))
    replicas = _set(p0, p1, d0, d1)
    prompt = list(range(100))
    first = replicas.pick(prompt, {})
    assert isinstance(first, Pair) and first.prefill in (p0, p1) and first.decode is d0  # idle: by name
    # That pair busy: the other prefill and the other decode replica (least load first).
    second = replicas.pick(prompt, {first: 1})
    other = p1 if first.prefill is p0 else p0
    assert (second.prefill, second.decode) == (other, d1)
    # Both busy alike: the prefill replica that served the prompt last (prefix affinity).
    third = replicas.pick(prompt, {first: 1, second: 1})
    assert (third.prefill, third.decode) == (other, d0)
    assert replicas.pick(prompt, {}) is third  # one object per pair: outstanding work adds up


def test_a_cluster_without_one_role_up_is_unavailable_and_null_replicas_stay_replicas():
    with pytest.raises(RequestError) as err:
        _set(FakeReplica("p0", "prefill"), FakeReplica("d0", "decode", up=False)).pick([1, 2], {})
    assert err.value.status == grpc.StatusCode.UNAVAILABLE
    assert err.value.message == "no prefill/decode pair is up (the replicas up are prefill)"
    plain = FakeReplica("r0", "null")
    assert _set(plain).pick([1, 2], {}) is plain


def test_the_decode_part_goes_first_and_the_prefill_part_names_the_decode_scheduler():
    p, d = FakeReplica("p0:1", "prefill"), FakeReplica("d0:2", "decode")
    req = scheduler_pb2.TokenizedGenerateReqInput(rid="r", input_ids=[5, 6], tokenizer_id="tok")
    Pair(p, d).send_req(req)  # type: ignore[arg-type]
    assert [(m.disagg_role, m.disagg_bootstrap, list(m.input_ids)) for m in d.sent + p.sent] == [
        (disagg_pb2.DISAGG_ROLE_DECODE, "", [5, 6]), (disagg_pb2.DISAGG_ROLE_PREFILL, "d0:2", [5, 6])]
    assert req.disagg_role == disagg_pb2.DISAGG_ROLE_NONE  # the caller's message is left as it was


def test_a_prefill_scheduler_down_aborts_the_decode_part_and_fails_the_send():
    p, d = FakeReplica("p0", "prefill", up=False), FakeReplica("d0", "decode")
    with pytest.raises(RequestError, match="the scheduler at p0 is not connected"):
        req = scheduler_pb2.TokenizedGenerateReqInput(rid="r", tokenizer_id="tok")
        Pair(p, d).send_req(req)  # type: ignore[arg-type]
    assert [type(m).__name__ for m in d.sent] == ["TokenizedGenerateReqInput", "AbortReq"]
    assert d.sent[1].rid == "r" and d.sent[1].reason == "the prefill scheduler is not connected"


def test_an_abort_reaches_every_member_up_and_fails_only_when_none_is():
    p, d = FakeReplica("p0", "prefill"), FakeReplica("d0", "decode", up=False)
    pair = Pair(p, d)  # type: ignore[arg-type]
    pair.send_abort(scheduler_pb2.AbortReq(rid="r"))
    assert [m.rid for m in p.sent] == ["r"]
    p.up = False
    with pytest.raises(RequestError):
        pair.send_abort(scheduler_pb2.AbortReq(rid="r"))


class PairBalancer:
    """The ReplicaSet's pick, always the one pair."""

    def __init__(self, pair: Pair):
        self.pair = pair

    def pick(self, input_ids, outstanding):
        return self.pair


async def test_losing_the_prefill_scheduler_fails_the_pairs_requests_and_aborts_them_on_the_decode_side(manager):
    p, d = FakeReplica("p0:1", "prefill"), FakeReplica("d0:2", "decode")
    pair = Pair(p, d)  # type: ignore[arg-type]
    manager.balancer = PairBalancer(pair)
    chat = tokenizer_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="user", content="Hi")])
    gen = manager.generate(tokenizer_pb2.GenerateReqInput(rid="r", chat=chat, stream=True))
    task = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0.01)
    assert [(m.rid, m.disagg_role) for m in d.sent + p.sent] == [
        ("r", disagg_pb2.DISAGG_ROLE_DECODE), ("r", disagg_pb2.DISAGG_ROLE_PREFILL)]
    assert dict(manager.outstanding) == {pair: 1}
    p.up = False
    assert manager.fail_all(unavailable("lost the connection to the scheduler at p0:1"), False, replica=p) == 1
    with pytest.raises(RequestError, match="lost the connection to the scheduler at p0:1"):
        await asyncio.wait_for(task, 1)
    assert [(type(m).__name__, m.rid) for m in d.sent[1:]] == [("AbortReq", "r")]  # the decode side frees it
    assert manager.load().req_states == 0 and dict(manager.outstanding) == {}
    await gen.aclose()


def _generate(manager, rid: str, n: int = 1):
    """A streaming Generate call's generator and the task awaiting its first output."""
    chat = tokenizer_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="user", content="Hi")])
    sampling = common_pb2.SamplingParams(n=n, temperature=0.5 if n > 1 else 0.0)
    gen = manager.generate(tokenizer_pb2.GenerateReqInput(rid=rid, chat=chat, stream=True, sampling_params=sampling))
    return gen, asyncio.ensure_future(gen.__anext__())


def _row(rid: str, finish: int = common_pb2.FINISH_NONE) -> detokenizer_pb2.BatchStrOutput:
    return detokenizer_pb2.BatchStrOutput(
        rids=[rid], texts=["Hello"], new_token_counts=[1], output_ids=[9], prompt_tokens=[0], completion_tokens=[1],
        cached_tokens=[0], finish_reasons=[common_pb2.FinishReason(type=finish)])


def _sent(replica: FakeReplica) -> list[tuple[str, str]]:
    return [(type(m).__name__, m.rid) for m in replica.sent]


async def test_a_lost_prefill_scheduler_sends_the_request_to_another_pair_and_frees_the_old_reservation(manager):
    p0, p1, d0 = FakeReplica("p0", "prefill"), FakeReplica("p1", "prefill"), FakeReplica("d0", "decode")
    manager.balancer = _set(p0, p1, d0)
    gen, first = _generate(manager, "r")
    await asyncio.sleep(0.01)
    old = manager.rid_to_state["r"].replica
    lost, other = (p0, p1) if old.prefill is p0 else (p1, p0)
    lost.up = False
    assert manager.fail_all(unavailable("lost the connection to the scheduler"), False, replica=lost) == 0
    # The old decode part is aborted before the new one arrives, on the same decode scheduler here.
    assert _sent(d0) == [("TokenizedGenerateReqInput", "r"), ("AbortReq", "r"),
                         ("TokenizedGenerateReqInput", "r/retry1")]
    assert [(m.rid, m.disagg_role, m.disagg_bootstrap) for m in other.sent] == [
        ("r/retry1", disagg_pb2.DISAGG_ROLE_PREFILL, "d0")]
    new = manager.balancer.pairs._pairs[(other.name, "d0")]
    assert dict(manager.outstanding) == {new: 1} and set(manager.rid_to_state) == {"r/retry1"}
    # The old decode side's final abort row reaches nothing; the new attempt's rows reach the call.
    manager.handle_batch(_row("r", common_pb2.FINISH_ABORT))
    manager.handle_batch(_row("r/retry1", common_pb2.FINISH_LENGTH))
    out = await asyncio.wait_for(first, 1)
    assert (out.rid, out.text, list(out.output_ids), out.finish_reason.type) == ("r", "Hello", [9],
                                                                                 common_pb2.FINISH_LENGTH)
    await gen.aclose()
    assert manager.load().req_states == 0 and dict(manager.outstanding) == {}


async def test_a_retried_request_is_aborted_by_its_call_rid_and_fails_when_its_second_prefill_goes_too(manager):
    p0, p1, d0 = FakeReplica("p0", "prefill"), FakeReplica("p1", "prefill"), FakeReplica("d0", "decode")
    manager.balancer = _set(p0, p1, d0)
    gen, first = _generate(manager, "q", n=2)
    await asyncio.sleep(0.01)
    lost = manager.rid_to_state["q-0"].replica.prefill
    lost.up = False
    assert manager.fail_all(unavailable("lost p"), False, replica=lost) == 0
    assert set(manager.rid_to_state) == {"q-0/retry1", "q-1/retry1"}
    assert manager.abort("q-1")  # the call's sub-rid reaches the attempt
    assert [m.rid for m in d0.sent if isinstance(m, scheduler_pb2.AbortReq)][-1] == "q-1/retry1"
    lost.up = True  # back, but the retry is spent: losing the second prefill scheduler fails the call
    second = manager.rid_to_state["q-0/retry1"].replica.prefill
    second.up = False
    assert manager.fail_all(unavailable("lost the second"), False, replica=second) == 2
    with pytest.raises(RequestError, match="lost the second"):
        await asyncio.wait_for(first, 1)
    await gen.aclose()
    assert manager.load().req_states == 0 and dict(manager.outstanding) == {}


async def test_a_request_whose_call_saw_output_or_that_has_no_other_prefill_fails_fast(manager):
    p0, p1, d0 = FakeReplica("p0", "prefill"), FakeReplica("p1", "prefill"), FakeReplica("d0", "decode")
    manager.balancer = _set(p0, p1, d0)
    gen, first = _generate(manager, "s")
    await asyncio.sleep(0.01)
    manager.handle_batch(_row("s"))  # the first token is on its way to the client
    assert (await asyncio.wait_for(first, 1)).text == "Hello"
    lost = manager.rid_to_state["s"].replica.prefill
    lost.up = False
    assert manager.fail_all(unavailable("lost p"), False, replica=lost) == 1
    with pytest.raises(RequestError, match="lost p"):
        await gen.__anext__()
    assert [n for n, _ in _sent(d0)] == ["TokenizedGenerateReqInput", "AbortReq"]  # not sent again

    manager.balancer = _set(p0, d0)  # one prefill scheduler: nothing else is eligible
    p0.up, d0.sent = True, []
    gen, first = _generate(manager, "t")
    await asyncio.sleep(0.01)
    p0.up = False
    assert manager.fail_all(unavailable("lost p0"), False, replica=p0) == 1
    with pytest.raises(RequestError, match="lost p0") as err:
        await asyncio.wait_for(first, 1)
    assert err.value.status == grpc.StatusCode.UNAVAILABLE and _sent(d0) == [
        ("TokenizedGenerateReqInput", "t"), ("AbortReq", "t")]
    await gen.aclose()
    assert manager.load().req_states == 0 and dict(manager.outstanding) == {}


def test_an_embedding_goes_whole_to_the_prefill_scheduler_and_reserves_nothing_on_the_decode_side():
    p, d = FakeReplica("p0:1", "prefill"), FakeReplica("d0:2", "decode")
    req = scheduler_pb2.TokenizedGenerateReqInput(rid="e", input_ids=[5, 6], tokenizer_id="tok", embed=True)
    Pair(p, d).send_req(req)  # type: ignore[arg-type]
    assert d.sent == [] and p.sent == [req]
    assert (p.sent[0].disagg_role, p.sent[0].disagg_bootstrap) == (disagg_pb2.DISAGG_ROLE_NONE, "")
