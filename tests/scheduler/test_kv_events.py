"""KV-cache events from the radix cache (policy/radix_cache.py, policy/kv_events.py): replaying
them gives exactly the pages the cache holds, through inserts with shared prefixes, splits,
eviction under pressure and clears; a subscriber that resumes from its last sequence misses
nothing; the keys are ``ringserve.kv_events``'s function of the token ids."""

from __future__ import annotations

import random

import pytest
import torch

from ringserve.kv_events import PAGE_SIZE, ROOT_PARENT, page_hash, prefix_page_hashes
from services.scheduler.policy.kv_events import (
    CacheCleared,
    EventsDropped,
    KvEventBatch,
    KvEventLog,
    PagesRemoved,
    PagesStored,
)
from services.scheduler.policy.kv_pool import TokenToKVPool
from services.scheduler.policy.radix_cache import RadixCache, TreeNode
from tests.helpers.fake_runner import FakeRunner, create_policy, make_req

P = PAGE_SIZE


def cache(kv_tokens: int = 4096) -> tuple[RadixCache, KvEventLog]:
    log = KvEventLog()
    pool = TokenToKVPool(kv_tokens, num_layers=1, kv_heads=1, head_dim=1, dtype=torch.float32)
    return RadixCache(pool, log), log


def insert(tree: RadixCache, key: list[int]) -> None:
    """What a finished request does: match, insert its tokens, free the rows the tree did not keep."""
    tree.match_prefix(key)
    rows = tree.kv_pool.alloc(len(key))
    kept = tree.insert(key, rows)
    tree.kv_pool.free(rows[:kept])


def held_pages(tree: RadixCache) -> set[int]:
    """Every full page of every root-to-leaf path: what the cache holds, by the documented key."""
    out: set[int] = set()
    stack: list[tuple[TreeNode, list[int]]] = [(tree.root, [])]
    while stack:
        node, path = stack.pop()
        path = path + node.key
        out.update(prefix_page_hashes(path))
        stack.extend((c, path) for c in node.children.values())
    return out


def replay(batches: list[KvEventBatch], index: set[int] | None = None, check_keys: bool = True) -> set[int]:
    """A router's index after ``batches``; each stored page's key is checked against the function."""
    index = set() if index is None else index
    for batch in batches:
        for event in batch.events:
            if isinstance(event, CacheCleared):
                index.clear()
            elif isinstance(event, PagesRemoved):
                assert set(event.hashes) <= index, "a page removed that was never stored"
                index.difference_update(event.hashes)
            else:
                assert isinstance(event, PagesStored) and event.page_size == P
                assert len(event.token_ids) == P * len(event.hashes)
                assert event.parent == ROOT_PARENT or event.parent in index, "stored before its parent"
                h = event.parent
                for i, key in enumerate(event.hashes):
                    h = page_hash(h, event.token_ids[i * P : (i + 1) * P])
                    assert key == h
                index.update(event.hashes)
    return index


def prompts(rng: random.Random, n: int) -> list[list[int]]:
    """Prompts of 5..120 tokens that share prefixes of many lengths (page-aligned or not)."""
    stems = [[rng.randrange(50) for _ in range(rng.randrange(1, 70))] for _ in range(6)]
    return [rng.choice(stems)[: rng.randrange(1, 70)] + [rng.randrange(50) for _ in range(rng.randrange(4, 50))]
            for _ in range(n)]


def test_a_page_key_is_sha256_of_the_parent_and_the_tokens_little_endian() -> None:
    import hashlib
    import struct

    tokens = list(range(1, 17))
    first = int.from_bytes(hashlib.sha256(bytes(8) + struct.pack("<16i", *tokens)).digest()[:8], "little")
    assert page_hash(ROOT_PARENT, tokens) == first
    second = int.from_bytes(hashlib.sha256(struct.pack("<Q", first) + struct.pack("<16i", *tokens)).digest()[:8],
                            "little")
    assert prefix_page_hashes(tokens * 2 + [7]) == [first, second]
    assert prefix_page_hashes(tokens[:15]) == []
    # The worked example of docs/kv_events.md.
    assert f"{first:016x}" == "fce0f15534b88a2a"
    assert f"{second:016x}" == "3bac7de13b2a14d0"


@pytest.mark.parametrize("seed", range(4))
def test_replay_from_zero_is_exactly_the_pages_held_through_inserts_evictions_and_clears(seed: int) -> None:
    rng = random.Random(seed)
    tree, log = cache(kv_tokens=600)  # small: inserts evict
    evicted = 0
    for step, prompt in enumerate(prompts(rng, 150)):
        if tree.kv_pool.available < len(prompt):
            evicted += tree.evict(len(prompt) - tree.kv_pool.available)
        insert(tree, prompt)
        if rng.random() < 0.3:
            tree.match_prefix(prompt[: rng.randrange(1, len(prompt) + 1)])  # a split mid-edge
        if step == 100:
            tree.reset()
            tree.kv_pool.reset()
        log.seal()
        assert replay(log.since(0)) == held_pages(tree)
    assert evicted > 0 and held_pages(tree)
    kinds = {type(e) for b in log.since(0) for e in b.events}
    assert kinds == {PagesStored, PagesRemoved, CacheCleared}
    assert [b.sequence for b in log.since(0)] == list(range(log.next_sequence))


def test_stored_keys_are_the_prompts_own_page_keys() -> None:
    tree, log = cache()
    a = list(range(100, 140))  # 2 full pages + 8
    b = a[:20] + list(range(500, 530))  # shares page 0 and 4 tokens of page 1
    insert(tree, a)
    insert(tree, b)
    log.seal()
    [batch] = log.since(0)
    stored = [e for e in batch.events if isinstance(e, PagesStored)]
    assert [list(e.hashes) for e in stored] == [prefix_page_hashes(a), prefix_page_hashes(b)[1:]]
    assert stored[1].parent == prefix_page_hashes(a)[0]
    assert list(stored[1].token_ids) == b[P : 3 * P]


def test_a_subscriber_resuming_from_its_last_sequence_misses_nothing() -> None:
    rng = random.Random(7)
    tree, log = cache(kv_tokens=500)
    index: set[int] = set()
    last = -1
    for i, prompt in enumerate(prompts(rng, 80)):
        if tree.kv_pool.available < len(prompt):
            tree.evict(len(prompt) - tree.kv_pool.available)
        insert(tree, prompt)
        log.seal()
        if i % 7 == 3:  # the subscriber was away since ``last``; it reconnects
            batches = log.since(last + 1)
            assert [b.sequence for b in batches] == list(range(last + 1, log.next_sequence))
            replay(batches, index)
            last = batches[-1].sequence
            assert index == held_pages(tree)
    replay(log.since(last + 1), index)
    assert index == held_pages(tree)


def test_a_bounded_buffer_refuses_what_it_dropped_and_a_snapshot_starts_over() -> None:
    tree, log = cache()
    log.max_pages = 10
    for i in range(12):
        insert(tree, [i] * (2 * P))  # two pages each
        log.seal()
    oldest = log.oldest_sequence()
    assert oldest == 12 - 5  # five batches of two pages fit
    with pytest.raises(EventsDropped) as info:
        log.since(0)
    assert (info.value.oldest, info.value.next) == (oldest, 12)
    assert "holds 7..11" in str(info.value)
    with pytest.raises(EventsDropped):
        log.since(13)  # a sequence this scheduler has not made (another process's)
    assert log.since(12) == []

    tree.record_snapshot()
    sequence = log.seal(snapshot=True)
    [snap] = log.since(sequence)
    assert snap.snapshot and isinstance(snap.events[0], CacheCleared)
    assert replay([snap], index={123}) == held_pages(tree)
    assert len(held_pages(tree)) == 24


def test_the_fake_runner_under_pressure_with_a_flush() -> None:
    """Requests through the scheduling policy (admission, eviction to fit, release into the
    cache), then a flush: the events track the tree at every step."""
    policy = create_policy(kv_tokens=160, max_running=3)
    log = KvEventLog()
    policy.tree.events = log  # type: ignore[union-attr]
    runner = FakeRunner(policy)
    shared = list(range(1, 40))
    for i in range(12):
        runner.add(make_req(f"r{i}", shared[: 20 + i] + [200 + i] * 20, max_new_tokens=6))
    while runner.step() is not None:
        log.seal()
        assert replay(log.since(0)) == held_pages(policy.tree)  # type: ignore[arg-type]
    assert len(runner.finished) == 12
    assert any(isinstance(e, PagesRemoved) for b in log.since(0) for e in b.events)
    policy.tree.reset()  # type: ignore[union-attr]
    policy.kv_pool.reset()
    log.seal()
    assert replay(log.since(0)) == set() == held_pages(policy.tree)  # type: ignore[arg-type]
