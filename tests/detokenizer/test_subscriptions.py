"""The detokenizer's subscription table and its Subscribe RPC, without a network or a vocabulary:
one live stream per tokenizer id; a second Subscribe for that id is refused and never takes
the owner's rows, nor, when it leaves, the owner's registration."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from ringserve.v1 import detokenizer_pb2
from services.detokenizer.servicer import AlreadySubscribed, DetokenizerServicer, Subscriptions
from tests.helpers.detokenizer_routing import RoutingManager, rows


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(code, details)
        self.code, self.details = code, details


class FakeContext:
    """The two ServicerContext calls Subscribe makes; ``abort`` raises, as grpc.aio's does."""

    def __init__(self) -> None:
        self.initial_metadata_sent = False

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)

    async def send_initial_metadata(self, _metadata) -> None:
        self.initial_metadata_sent = True


def subscribe(servicer: DetokenizerServicer, tokenizer_id: str, context: FakeContext):
    return servicer.Subscribe(detokenizer_pb2.SubscribeRequest(tokenizer_id=tokenizer_id), context)


def test_table_one_stream_per_id() -> None:
    table = Subscriptions()
    owner = table.add("tok-a")
    with pytest.raises(AlreadySubscribed, match="^tokenizer 'tok-a' is already subscribed on another stream$"):
        table.add("tok-a")
    assert table.get("tok-a") is owner and len(table) == 1
    stale: asyncio.Queue = asyncio.Queue()
    assert table.remove("tok-a", stale) is False  # not its entry: the owner stays
    assert table.get("tok-a") is owner
    assert table.remove("tok-a", owner) is True and "tok-a" not in table and len(table) == 0
    assert table.add("tok-a") is not owner  # free again
    assert table.get("tok-b") is None


async def test_a_second_subscribe_is_refused_and_the_owner_keeps_its_rows() -> None:
    servicer = DetokenizerServicer(RoutingManager(), "detok-test")
    owner_ctx = FakeContext()
    owner = subscribe(servicer, "tok-a", owner_ctx)
    first = asyncio.create_task(anext(owner))
    while not owner_ctx.initial_metadata_sent:  # registered
        await asyncio.sleep(0)

    intruder_ctx = FakeContext()
    with pytest.raises(Aborted) as info:
        await asyncio.wait_for(anext(subscribe(servicer, "tok-a", intruder_ctx)), 1)
    assert (info.value.code, info.value.details) == (
        grpc.StatusCode.ALREADY_EXISTS, "tokenizer 'tok-a' is already subscribed on another stream")
    assert not intruder_ctx.initial_metadata_sent

    # The refused stream has left: the owner is still the one registered and gets its rows.
    servicer.route(rows("r1", "tok-a"))
    assert list((await asyncio.wait_for(first, 1)).rids) == ["r1"]
    servicer.route(rows("r2", "tok-a"))
    assert list((await asyncio.wait_for(anext(owner), 1)).rids) == ["r2"]

    # The owner leaving frees the id; a new subscriber (a restarted tokenizer) takes it.
    await owner.aclose()
    assert "tok-a" not in servicer.subscribers
    again_ctx = FakeContext()
    again = subscribe(servicer, "tok-a", again_ctx)
    pending = asyncio.create_task(anext(again))
    while not again_ctx.initial_metadata_sent:
        await asyncio.sleep(0)
    servicer.route(rows("r3", "tok-a"))
    assert list((await asyncio.wait_for(pending, 1)).rids) == ["r3"]
    await again.aclose()
    assert len(servicer.subscribers) == 0
