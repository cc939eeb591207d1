"""KV-cache events through the public gRPC API (the tokenizer relays its replica's scheduler),
on the default ring: chats sharing a long system prompt store pages whose keys are
``ringserve.kv_events``'s function of the prompt's token ids (from /v1/tokenize); a
subscriber that resumes from its last sequence gets the batches after it; /flush_cache
clears."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import httpx

from ringserve.kv_events import PAGE_SIZE, ROOT_PARENT, page_hash, prefix_page_hashes
from ringserve.v1 import kv_events_pb2, tokenizer_pb2_grpc


class Index:
    """A router's view of one replica, built from the relayed batches."""

    def __init__(self) -> None:
        self.pages: set[int] = set()
        self.batches: list[kv_events_pb2.KvEventBatch] = []
        self.stored_count: dict[int, int] = {}

    def apply(self, batch: kv_events_pb2.KvEventBatch) -> None:
        if self.batches:
            assert batch.sequence == self.batches[-1].sequence + 1  # no gap
        self.batches.append(batch)
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "cleared":
                self.pages.clear()
            elif kind == "removed":
                self.pages.difference_update(event.removed.page_hashes)
            else:
                stored = event.stored
                assert stored.page_size == PAGE_SIZE
                h = stored.parent_hash
                assert h == ROOT_PARENT or h in self.pages
                for i, key in enumerate(stored.page_hashes):
                    h = page_hash(h, stored.token_ids[i * PAGE_SIZE : (i + 1) * PAGE_SIZE])
                    assert key == h  # the documented function, from the event's own tokens
                    self.stored_count[key] = self.stored_count.get(key, 0) + 1
                self.pages.update(stored.page_hashes)

    async def follow(self, call) -> None:
        async for batch in call:
            self.apply(batch)

    async def wait_for(self, predicate, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"last sequence {self.batches[-1].sequence if self.batches else None}"
            await asyncio.sleep(0.05)


FOURTH = "And what is the capital of Portugal, the country west of Spain on the Atlantic coast of Europe?"


def messages(system: str, question: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def test_kv_events_replay_resume_and_flush_through_the_public_api(stack):
    stack.wait_idle()
    # A system prompt no other test sends: its pages are new to the cache.
    system = f"Session {uuid.uuid4().hex}. You are a careful assistant who answers geography questions " \
             "in one short sentence, naming the country and the city, and nothing else at all."
    questions = ["What is the capital of France?", "What is the capital of Italy?", "What is the capital of Spain?"]
    async with grpc.aio.insecure_channel(stack.tokenizer) as channel, \
            httpx.AsyncClient(base_url=stack.base_url, headers=stack.http_headers, timeout=60) as client:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        index = Index()
        call = stub.SubscribeKvEvents(kv_events_pb2.SubscribeKvEventsRequest(snapshot=True),
                                      metadata=stack.grpc_metadata)
        follower = asyncio.create_task(index.follow(call))
        await index.wait_for(lambda: bool(index.batches))
        assert index.batches[0].snapshot and index.batches[0].events[0].WhichOneof("event") == "cleared"
        assert index.batches[0].replica == stack.scheduler

        keys = []
        for q in questions:
            r = await client.post("/v1/chat/completions", json={
                "model": stack.model_name, "messages": messages(system, q), "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
            t = await client.post("/v1/tokenize", json={"model": stack.model_name, "messages": messages(system, q),
                                                         "add_generation_prompt": True})
            ids = t.json()["tokens"]
            assert r.json()["usage"]["prompt_tokens"] == len(ids)
            keys.append(prefix_page_hashes(ids))
            await index.wait_for(lambda k=keys[-1]: set(k) <= index.pages)
        shared = [k for k in keys[0] if all(k in ks for ks in keys)]
        assert len(shared) >= 3  # the system prompt's pages, common to the three prompts
        # Stored once, by the first request; the others found them cached.
        assert [index.stored_count[k] for k in shared] == [1] * len(shared)
        assert all(index.stored_count[k] == 1 for ks in keys for k in ks)

        # A subscriber that left resumes from its last sequence + 1 and misses nothing.
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        last = index.batches[-1].sequence
        r = await client.post("/v1/chat/completions", json={
            "model": stack.model_name, "messages": messages(system, FOURTH), "max_tokens": 4,
            "temperature": 0})
        assert r.status_code == 200
        call = stub.SubscribeKvEvents(kv_events_pb2.SubscribeKvEventsRequest(start_sequence=last + 1),
                                      metadata=stack.grpc_metadata)
        follower = asyncio.create_task(index.follow(call))
        t = await client.post("/v1/tokenize", json={"model": stack.model_name,
                                                     "messages": messages(system, FOURTH),
                                                     "add_generation_prompt": True})
        fourth = prefix_page_hashes(t.json()["tokens"])
        assert set(fourth) - {k for ks in keys for k in ks}  # pages no earlier prompt had
        await index.wait_for(lambda: set(fourth) <= index.pages)
        assert index.batches[-1].sequence > last

        # No flush while a request is in flight; then a flush empties the cache: one batch with a clear.
        stack.wait_idle()
        async with client.stream("POST", "/v1/chat/completions", json={
                "model": stack.model_name, "messages": messages(system, "Tell a long story."), "max_tokens": 500,
                "ignore_eos": True, "stream": True}) as running:
            assert running.status_code == 200
            r = await client.post("/flush_cache")
            assert r.status_code == 400 and r.json()["error"]["code"] == "failed_precondition", r.text
            assert "requests are in flight" in r.json()["error"]["message"]
        stack.wait_idle()
        r = await client.post("/flush_cache")
        assert (r.status_code, r.json()) == (200, {"flushed": True})
        await index.wait_for(lambda: index.batches[-1].events[-1].WhichOneof("event") == "cleared")
        assert index.pages == set()
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)

        # A replica the tokenizer does not have is refused, naming the ones it has.
        call = stub.SubscribeKvEvents(kv_events_pb2.SubscribeKvEventsRequest(replica="10.0.0.1:1"),
                                      metadata=stack.grpc_metadata)
        try:
            await call.read()
            raise AssertionError("no error")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert exc.details() == f"no replica '10.0.0.1:1': this tokenizer's replicas are {stack.scheduler}"

        # A sequence the buffer never held is refused with the range it holds.
        call = stub.SubscribeKvEvents(kv_events_pb2.SubscribeKvEventsRequest(start_sequence=10**9),
                                      metadata=stack.grpc_metadata)
        try:
            await call.read()
            raise AssertionError("no error")
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.OUT_OF_RANGE
            assert f"from sequence {10**9} are not available" in (exc.details() or "")
