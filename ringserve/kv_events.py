"""The keys of ringserve's KV-cache events: page hashes an external router computes from token
ids alone (no torch; the scheduler, the tests and any router import this one module).

A page is ``PAGE_SIZE`` consecutive tokens of a prompt, aligned on multiples of ``PAGE_SIZE``
from its first token; only full pages have a hash. The hash of page ``k`` is chained on the
hash of page ``k - 1`` (0 for the first page), so it names the whole prefix up to the page's
end, not only the page's own tokens:

    page_hash(parent, tokens) = the first 8 bytes, read as a little-endian uint64, of
        SHA-256( parent as 8 bytes little-endian unsigned
                 || each token id as 4 bytes little-endian signed (int32) )

This is vLLM's scheme (a block's hash chained on its parent block's, over the block's token
ids) with a hash defined byte for byte, so a router in any language computes the same key.
A worked example is in docs/kv_events.md.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Tokens per page of the events. The KV pool itself is token-granular (a page of one token);
# events group 16, vLLM's default block size and the one llm-d's and Dynamo's indexers use
# unless told otherwise, so a router indexes 1/16 as many keys.
PAGE_SIZE = 16
ROOT_PARENT = 0  # the parent hash of a prompt's first page

_PARENT = struct.Struct("<Q")


def page_hash(parent: int, tokens: Sequence[int]) -> int:
    """The key of one page: ``tokens`` (its token ids, int32 range) after the prefix whose
    last page hashed to ``parent`` (``ROOT_PARENT`` for the first page). Returns a uint64.

    Raises:
        struct.error: a token id outside the int32 range, or ``parent`` outside uint64.
    """
    data = _PARENT.pack(parent) + struct.pack(f"<{len(tokens)}i", *tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def prefix_page_hashes(token_ids: Sequence[int], page_size: int = PAGE_SIZE) -> list[int]:
    """The chained keys of every full page of ``token_ids`` (a partial last page has none):
    ``len(token_ids) // page_size`` uint64s, page 0 first."""
    out: list[int] = []
    parent = ROOT_PARENT
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = page_hash(parent, token_ids[start : start + page_size])
        out.append(parent)
    return out
