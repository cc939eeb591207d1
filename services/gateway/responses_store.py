"""The gateway's store of finished responses, for ``GET``/``DELETE /v1/responses/{id}`` and
``previous_response_id``.

A bounded LRU in this process's memory: at most ``--responses-store-max`` responses and
about ``--responses-store-max-bytes`` of JSON (each entry counts its response object and its
whole conversation, items shared with earlier entries included, so the bound holds however
the entries share them). The least recently stored or read entries go first; one larger
than the whole budget is not kept. Nothing survives a restart, and each gateway replica has
its own store: a ``previous_response_id`` stored by another replica is unknown here (404),
so clients of a multi-replica gateway need session affinity, or ``store: false`` with the
whole conversation sent as ``input``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .responses_protocol import InputItem
from .sse import dumps


@dataclass(frozen=True)
class Stored:
    response: dict  # the response object as returned
    conversation: tuple[InputItem, ...]  # what previous_response_id continues: inputs, then outputs
    conversation_bytes: int  # JSON size of the conversation


def items_bytes(items: list[InputItem] | tuple[InputItem, ...]) -> int:
    """The JSON size of ``items`` (as they were validated)."""
    return sum(len(dumps(item.model_dump(exclude_none=True))) for item in items)


class ResponseStore:
    """An LRU of finished responses by id; ``max_responses`` 0 turns it off."""

    def __init__(self, max_responses: int, max_bytes: int):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Stored, int]] = OrderedDict()  # id -> (entry, bytes)
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_responses > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> Stored | None:
        """The entry (now the most recently used), or None."""
        found = self._entries.get(response_id)
        if found is None:
            return None
        self._entries.move_to_end(response_id)
        return found[0]

    def put(self, entry: Stored) -> bool:
        """Keep ``entry`` under its response's id, evicting the least recently used entries
        over the bounds; False when it alone is over the byte budget (not kept)."""
        size = len(dumps(entry.response)) + entry.conversation_bytes
        if not self.enabled or size > self.max_bytes:
            return False
        self.delete(entry.response["id"])
        self._entries[entry.response["id"]] = (entry, size)
        self.bytes += size
        while len(self._entries) > self.max_responses or self.bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted
        return True

    def delete(self, response_id: str) -> bool:
        found = self._entries.pop(response_id, None)
        if found is None:
            return False
        self.bytes -= found[1]
        return True
