"""Which model replica serves a request: least outstanding work, then prefix affinity.

Plain Python, no network: the tokenizer service feeds it the eligible replicas and
how many requests it has in flight on each, and tells it where each prompt went.

Policy (after SGLang's cache-aware router, ``sgl-router`` ``cache_aware`` policy, which
keeps an approximate radix tree of the prompts each worker served and sends a request
to the worker with the longest match unless the load is imbalanced; here load comes
first and the prefix only breaks ties, so no replica is overloaded for a cache hit):

1. **Least outstanding work**: the replica with the fewest requests that *this*
   tokenizer instance dispatched there and that have not finished. Each instance
   balances its own share; gateways spread calls over instances (round_robin), so
   the shares add up to an even spread without any shared state.
2. **Prefix affinity**: among the least-loaded, the replica that most recently
   served the longest run of the prompt's leading token blocks. Blocks are
   ``block_size`` tokens; block i's key is a hash chained over blocks 0..i (the way
   vLLM's prefix-caching block hashes are chained), so a key names the whole prefix
   up to that block. The last replica per key is kept in a bounded LRU map.
3. **Rendezvous hash** (highest random weight, Thaler & Ravishankar 1998) of the
   prompt's first ``key_tokens`` tokens over the replica names. Deterministic across
   processes, so two tokenizer instances that have never seen a prefix still send it
   to the same replica, and distinct prompts spread evenly when the replicas are idle.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence

DEFAULT_BLOCK_SIZE = 16
DEFAULT_KEY_TOKENS = 64
DEFAULT_MAX_ENTRIES = 1 << 16


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_keys(input_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
    """Chained keys of the prompt's full leading blocks.

    Args:
        input_ids: the prompt's token ids.
        block_size: tokens per block (> 0).

    Returns:
        One 64-bit key per full block: key i hashes key i-1 and the ids of block i, so
        equal keys mean equal prefixes (up to hash collisions). A prompt shorter than
        a block has no keys.
    """
    keys, prev = [], 0
    for start in range(0, len(input_ids) - block_size + 1, block_size):
        block = array("q", input_ids[start : start + block_size]).tobytes()
        prev = _digest(prev.to_bytes(8, "little") + block)
        keys.append(prev)
    return keys


def rendezvous_weight(name: str, key: int) -> int:
    """Highest-random-weight score of replica ``name`` for ``key`` (64-bit, process independent)."""
    return _digest(name.encode() + key.to_bytes(8, "little"))


class Router:
    """Picks a replica per request; remembers which replica served which prefix.

    Args:
        block_size: tokens per affinity block.
        key_tokens: how many leading tokens decide the rendezvous hash.
        max_entries: bound of the prefix -> replica LRU map (least recently used dropped).
    """

    def __init__(
        self,
        block_size: int = DEFAULT_BLOCK_SIZE,
        key_tokens: int = DEFAULT_KEY_TOKENS,
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ):
        if block_size <= 0 or key_tokens <= 0 or max_entries <= 0:
            raise ValueError("block_size, key_tokens and max_entries must be positive")
        self.block_size = block_size
        self.key_tokens = key_tokens
        self.max_entries = max_entries
        self._owner: OrderedDict[int, str] = OrderedDict()  # block key -> replica name

    def __len__(self) -> int:
        return len(self._owner)

    def affinity(self, input_ids: Sequence[int]) -> dict[str, int]:
        """Replica name -> leading blocks of ``input_ids`` it served last (absent: none)."""
        matched: dict[str, int] = {}
        for depth, key in enumerate(block_keys(input_ids, self.block_size), start=1):
            owner = self._owner.get(key)
            if owner is None:
                break  # a later block cannot be cached where this one is not
            matched[owner] = depth
        return matched

    def choose(self, input_ids: Sequence[int], outstanding: Mapping[str, int]) -> str:
        """The replica for a prompt.

        Args:
            input_ids: the prompt's token ids.
            outstanding: eligible replica name -> requests in flight there (>= 0).

        Returns:
            The chosen replica's name (see the module docstring for the order).

        Raises:
            ValueError: ``outstanding`` is empty (no eligible replica).
        """
        if not outstanding:
            raise ValueError("no eligible replica")
        matched = self.affinity(input_ids)
        head = _digest(array("q", input_ids[: self.key_tokens]).tobytes())
        return min(
            outstanding,
            key=lambda name: (outstanding[name], -matched.get(name, 0), -rendezvous_weight(name, head)),
        )

    def record(self, input_ids: Sequence[int], name: str) -> None:
        """Remember that replica ``name`` now holds (or will hold) this prompt's prefix."""
        for key in block_keys(input_ids, self.block_size):
            self._owner[key] = name
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def forget(self, name: str) -> int:
        """Drop every prefix recorded for ``name`` (its cache is gone: it restarted); return how many."""
        keys = [k for k, owner in self._owner.items() if owner == name]
        for key in keys:
            del self._owner[key]
        return len(keys)
