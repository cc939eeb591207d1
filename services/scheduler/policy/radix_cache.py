"""Prefix (radix) cache over the token-granular KV pool.

SGLang's ``RadixCache`` (Zheng et al. 2024, "SGLang: Efficient Execution of Structured
Language Model Programs"): a radix tree whose edges are token runs and whose values are
the KV pool rows holding those tokens' K/V. A new request reuses the rows of its longest
cached prefix; a node in use by a request is locked (``lock_ref`` > 0 on it and every
ancestor) and never evicted; under memory pressure unlocked leaves go first, least
recently used first. Finished, aborted and retracted requests insert their computed
tokens, so the cache owns those rows until it evicts them.

Accounting: every row the tree holds is either ``protected`` (some request locks it) or
``evictable``; the engine reports evictable rows as cached, not used.

Events (``events``, a ``KvEventLog``): the tree names what it holds in pages of ``PAGE_SIZE``
tokens aligned from the start of each path (``ringserve.kv_events``), although its edges are
token-granular. A page belongs to the node whose edge holds the page's last token; each node
keeps the chained hashes of its pages (``pages``) and where its edge starts (``start``). A new
leaf records the pages it completes as stored, an evicted leaf its pages as removed, a reset a
clear; a split only moves pages between the two halves, so it records nothing. The pages
recorded are then exactly the full pages of every path in the tree.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch

from ringserve.kv_events import PAGE_SIZE, ROOT_PARENT, page_hash
from services.scheduler.policy.kv_events import KvEventLog
from services.scheduler.policy.kv_pool import TokenToKVPool

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """An edge of token ids ``key`` with its KV rows ``value`` (int64, same length), starting
    ``start`` tokens from the root; ``pages``: hashes of the event pages ending in the edge."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "start", "pages")

    def __init__(self, parent: TreeNode | None, key: list[int], value: torch.Tensor, tick: int, start: int = 0):
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = tick
        self.start = start
        self.pages: list[int] = []


class RadixCache:
    """Token-granular radix tree mapping token prefixes to KV pool rows.

    Not thread-safe; ``evictable_size`` / ``protected_size`` are plain ints, safe to read
    from another thread.
    """

    def __init__(self, kv_pool: TokenToKVPool, events: KvEventLog | None = None):
        self.kv_pool = kv_pool
        self._clock = itertools.count()
        self.events: KvEventLog | None = None
        self.reset()
        self.events = events

    def reset(self) -> None:
        """Forget every node (the caller resets the KV pool's free list); records a clear."""
        if self.events is not None:
            self.events.cleared()
        self.root = TreeNode(None, [], _EMPTY, next(self._clock))
        self.root.lock_ref = 1  # the root is never evicted
        self.evictable_size = 0
        self.protected_size = 0

    # ---- lookup and insertion ---------------------------------------------------------
    def match_prefix(self, key: Sequence[int]) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of ``key`` -> (int64 [n] KV rows, the node where it ends).

        A match ending inside an edge splits that edge, so the returned node covers
        exactly the matched tokens and can be locked on its own.
        """
        node, values, i = self.root, [], 0
        tick = next(self._clock)
        node.last_access = tick
        while i < len(key) and key[i] in node.children:
            child = node.children[key[i]]
            n = _common_len(child.key, key, i)
            if n < len(child.key):
                child = self._split(child, n)
            values.append(child.value)
            child.last_access = tick
            node, i = child, i + n
        return (torch.cat(values) if values else _EMPTY), node

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        """Insert ``key`` with its KV rows ``value`` (int64 [len(key)]).

        Returns how many leading tokens were already cached: the caller still owns
        ``value[:returned]`` and frees the rows the tree did not keep (duplicates of what
        the tree holds, except rows the tree itself lent to the caller).
        """
        node, i = self.root, 0
        tick = next(self._clock)
        while i < len(key):
            child = node.children.get(key[i])
            if child is None:
                leaf = TreeNode(node, list(key[i:]), value[i:].clone(), tick, i)
                node.children[key[i]] = leaf
                self.evictable_size += len(leaf.key)
                if self.events is not None:
                    self._record_stored(leaf, key)
                return i
            n = _common_len(child.key, key, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            node, i = child, i + n
        return i

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child``'s edge after ``n`` tokens; returns the new upper node."""
        upper = TreeNode(child.parent, child.key[:n], child.value[:n], child.last_access, child.start)
        upper.lock_ref = child.lock_ref
        upper.children = {child.key[n]: child}
        child.parent.children[child.key[0]] = upper
        child.parent, child.key, child.value = upper, child.key[n:], child.value[n:]
        if child.pages:
            # Pages whose last token is among the first n go up with it.
            upper_pages = (child.start + n) // PAGE_SIZE - child.start // PAGE_SIZE
            upper.pages, child.pages = child.pages[:upper_pages], child.pages[upper_pages:]
        child.start += n
        return upper

    def _record_stored(self, leaf: TreeNode, key: Sequence[int]) -> None:
        """Hash the pages ``leaf`` completes (``key``: its whole path) and record them."""
        first, end = leaf.start // PAGE_SIZE, (leaf.start + len(leaf.key)) // PAGE_SIZE
        if first == end:
            return
        parent = self._parent_hash(leaf)
        h = parent
        for k in range(first, end):
            h = page_hash(h, key[k * PAGE_SIZE : (k + 1) * PAGE_SIZE])
            leaf.pages.append(h)
        assert self.events is not None
        self.events.stored(parent, leaf.pages, key[first * PAGE_SIZE : end * PAGE_SIZE])

    def _parent_hash(self, node: TreeNode) -> int:
        """The hash of the last page before ``node``'s own: the nearest ancestor's last page."""
        up = node.parent
        while up is not None and not up.pages:
            up = up.parent
        return up.pages[-1] if up is not None else ROOT_PARENT

    def record_snapshot(self) -> None:
        """Record a clear, then every page the tree holds, each node's after its parent's
        (for a subscriber that starts over; the caller seals them as one batch)."""
        if self.events is None:
            return
        self.events.cleared()
        stack: list[tuple[TreeNode, list[int]]] = [(c, []) for c in self.root.children.values()]
        while stack:
            node, before = stack.pop()
            path = before + node.key
            if node.pages:
                first = node.start // PAGE_SIZE
                tokens = path[first * PAGE_SIZE : (first + len(node.pages)) * PAGE_SIZE]
                self.events.stored(self._parent_hash(node), node.pages, tokens)
            stack.extend((c, path) for c in node.children.values())

    # ---- locks -----------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock ``node`` and its ancestors: their rows move from evictable to protected."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``."""
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent

    # ---- eviction --------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` rows from unlocked leaves, LRU first (fewer if
        not enough are unlocked). Returns how many rows were freed."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            self.kv_pool.free(leaf.value)
            if leaf.pages and self.events is not None:
                self.events.removed(leaf.pages)
            freed += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size


def _common_len(edge: list[int], key: Sequence[int], start: int) -> int:
    n = min(len(edge), len(key) - start)
    for j in range(n):
        if edge[j] != key[start + j]:
            return j
    return n
