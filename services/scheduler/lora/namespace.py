"""The prefix cache's namespaces: KV computed under one adapter is never reused under another.

The radix tree (``policy.radix_cache``) branches at a path's first token id. A request under
an adapter keys the tree with its first id moved into a range of the adapter's namespace,
so its paths share no node with the base model's or another adapter's. Each load of an
adapter gets a new namespace (``lora.registry``), so a reload under the same name never
reuses the KV of the weights it replaced while the cache still holds them (namespaces cycle
after 4095 loads).
"""

from __future__ import annotations

# Namespaced ids stay in the int32 range the KV events hash (ringserve.kv_events):
# 4095 namespaces of 2^19 ids each, beyond every served vocabulary (Gemma 3's 262,208).
NAMESPACE_IDS = 1 << 19
NAMESPACES = 4095


def namespaced(ids: list[int], namespace: int) -> list[int]:
    """A request's token ids as the prefix cache keys them: under an adapter's namespace the
    first id is moved to a negative range of its own (ids is changed and returned), so no
    path of one namespace shares a node with another's (the tree branches at the first id)."""
    if namespace and ids:
        ids[0] = -1 - ids[0] - namespace * NAMESPACE_IDS
    return ids
