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
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import torch

from services.scheduler.policy.kv_pool import TokenToKVPool

_EMPTY = torch.empty(0, dtype=torch.int64)


class TreeNode:
    """An edge of token ids ``key`` with its KV rows ``value`` (int64, same length)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, parent: TreeNode | None, key: list[int], value: torch.Tensor, tick: int):
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = tick


class RadixCache:
    """Token-granular radix tree mapping token prefixes to KV pool rows.

    Not thread-safe; ``evictable_size`` / ``protected_size`` are plain ints, safe to read
    from another thread.
    """

    def __init__(self, kv_pool: TokenToKVPool):
        self.kv_pool = kv_pool
        self._clock = itertools.count()
        self.reset()

    def reset(self) -> None:
        """Forget every node (the caller resets the KV pool's free list)."""
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
                leaf = TreeNode(node, list(key[i:]), value[i:].clone(), tick)
                node.children[key[i]] = leaf
                self.evictable_size += len(leaf.key)
                return i
            n = _common_len(child.key, key, i)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = tick
            node, i = child, i + n
        return i

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child``'s edge after ``n`` tokens; returns the new upper node."""
        upper = TreeNode(child.parent, child.key[:n], child.value[:n], child.last_access)
        upper.lock_ref = child.lock_ref
        upper.children = {child.key[n]: child}
        child.parent.children[child.key[0]] = upper
        child.parent, child.key, child.value = upper, child.key[n:], child.value[n:]
        return upper

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
