"""Radix (prefix) cache: longest-prefix match, locks, LRU eviction of unlocked leaves, and
the engine reusing a cached prompt prefix with identical greedy output."""

from __future__ import annotations

import torch

from services.scheduler.policy.kv_pool import TokenToKVPool
from services.scheduler.policy.radix_cache import RadixCache


def tiny_tree(size: int = 64) -> tuple[RadixCache, TokenToKVPool]:
    pool = TokenToKVPool(size, 1, 1, 2, torch.float32)
    return RadixCache(pool), pool


def put(tree: RadixCache, pool: TokenToKVPool, key: list[int]) -> torch.Tensor:
    """Insert ``key`` the way a finished request does: fresh rows, duplicates freed."""
    rows = pool.alloc(len(key))
    kept = tree.insert(key, rows)
    pool.free(rows[:kept])
    return rows


def test_match_splits_edges_and_returns_rows():
    tree, pool = tiny_tree()
    a = put(tree, pool, [1, 2, 3, 4, 5])
    b = put(tree, pool, [1, 2, 3, 9])  # shares 3 tokens: only its last token takes a new row
    assert pool.used == 6 and tree.evictable_size == 6
    rows, node = tree.match_prefix([1, 2, 3, 4, 7])
    assert rows.tolist() == a[:4].tolist() and node.key == [4]  # split after [1, 2, 3]
    assert tree.match_prefix([1, 2, 3, 9, 9])[0].tolist() == a[:3].tolist() + b[3:].tolist()
    assert tree.match_prefix([2, 3])[0].numel() == 0


def test_evict_frees_exactly_the_unlocked_leaves_lru_first():
    tree, pool = tiny_tree()
    put(tree, pool, [1, 2, 3, 4])      # oldest
    put(tree, pool, [1, 2, 7, 8, 9])   # shares [1, 2]
    put(tree, pool, [5, 6])            # newest
    _, node = tree.match_prefix([1, 2, 7, 8, 9])  # touches and then locks this branch
    tree.inc_lock_ref(node)
    assert (tree.protected_size, tree.evictable_size) == (5, 4)
    # Only [3, 4] and [5, 6] are unlocked leaves; [3, 4] was used least recently.
    assert tree.evict(1) == 2 and tree.match_prefix([1, 2, 3, 4])[0].numel() == 2
    assert tree.evict(100) == 2  # everything unlocked, and no more
    assert (pool.used, tree.protected_size, tree.evictable_size) == (5, 5, 0)
    assert tree.match_prefix([1, 2, 7, 8, 9])[0].numel() == 5  # the locked prefix survived
    tree.dec_lock_ref(node)
    assert (tree.protected_size, tree.evictable_size) == (0, 5)
    assert tree.evict(5) == 5 and pool.used == 0 and not tree.root.children


def test_repeated_prompt_reuses_all_but_its_last_token(make_engine, chat_ids, greedy_req, run_all):
    prompt = chat_ids("Describe a lighthouse at night.")
    engine = make_engine()
    engine.add_request(greedy_req("first", prompt, 10, ignore_eos=True))
    first = run_all(engine)["first"]
    load = engine.load()
    # The finished request's computed tokens (prompt + 9 outputs; the 10th has no K/V) stay cached.
    assert (load.kv_used_tokens, load.kv_cached_tokens) == (0, len(prompt) + 9)
    engine.add_request(greedy_req("again", prompt, 10, ignore_eos=True))
    again = run_all(engine)["again"]
    # The last prompt token is always recomputed: its logits pick the first output token.
    assert (first.cached_tokens, again.cached_tokens) == (0, len(prompt) - 1)
    assert again.output_ids == first.output_ids

    plain = make_engine(disable_radix_cache=True)
    plain.add_request(greedy_req("plain", prompt, 10, ignore_eos=True))
    res = run_all(plain)["plain"]
    assert res.output_ids == first.output_ids and res.cached_tokens == 0
    assert (plain.load().kv_used_tokens, plain.load().kv_cached_tokens) == (0, 0)


def test_shared_prefix_is_locked_while_in_use_and_released_on_abort(make_engine, chat_ids, greedy_req, run_all):
    engine = make_engine()
    system = chat_ids("You are a terse assistant. Answer in one word.")
    engine.add_request(greedy_req("warm", system, 2, ignore_eos=True))
    warm = run_all(engine)["warm"]
    prompt = system + chat_ids("Name a metal.")
    engine.add_request(greedy_req("user", prompt, 50, ignore_eos=True))
    results = run_all(engine, {}, max_steps=3)
    tree = engine.tree
    cached = system + warm.output_ids[:1]  # the warm-up's computed tokens
    shared = next(i for i, (a, b) in enumerate(zip(cached + [-1], prompt, strict=False)) if a != b)
    assert results["user"].cached_tokens == tree.protected_size == shared >= len(system)
    tree.evict(10**6)  # evicts every unlocked row, never the prefix "user" holds
    assert tree.protected_size == shared and tree.evictable_size == 0
    slot = engine.reqs["user"].req_slot
    assert tree.match_prefix(prompt)[0].tolist() == engine.req_pool.req_to_token[slot, :shared].tolist()
    engine.abort(rid="user")
    run_all(engine, results)
    load = engine.load()
    assert tree.protected_size == 0 and load.kv_used_tokens == 0 and load.req_slots_used == 0
    assert load.kv_cached_tokens == tree.evictable_size == engine.kv_pool.used


def test_tiny_pool_evicts_cached_prefixes_to_admit_new_prompts(make_engine, chat_ids, greedy_req, run_all):
    prompts = [chat_ids(f"Give me a fact about the number {n}.") for n in range(6)]
    budget = 2 * (len(prompts[0]) + 8)
    engine = make_engine(max_total_tokens=budget)
    ref = make_engine(disable_radix_cache=True)
    for i, ids in enumerate(prompts):
        engine.add_request(greedy_req(f"p{i}", ids, 6, ignore_eos=True))
        ref.add_request(greedy_req(f"p{i}", ids, 6, ignore_eos=True))
        got, want = run_all(engine)[f"p{i}"], run_all(ref)[f"p{i}"]
        assert got.output_ids == want.output_ids
        load = engine.load()
        assert load.kv_used_tokens == 0 and load.kv_cached_tokens == engine.kv_pool.used <= budget
    # Six prompts' worth of tokens passed through a pool that holds about two.
    assert sum(len(p) + 5 for p in prompts) > budget
