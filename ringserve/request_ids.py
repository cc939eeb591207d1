"""Request ids across the ring: the HTTP ``X-Request-Id`` header and the gRPC ``x-request-id``
metadata name the rid a request is served, logged and traced under.

The rid itself is any non-empty string (the body's ``rid``, vLLM's ``request_id``). An id
given as a header or metadata value must also be one visible ASCII word (``!`` to ``~``, no
spaces), since it travels as one; a rid outside that set goes back in ``X-Request-Id``
percent-encoded (``header_value``).
"""

from __future__ import annotations

import re
from urllib.parse import quote

HEADER = "x-request-id"  # HTTP header and gRPC metadata key (lower case, as both carry it)
_WORD = re.compile(r"[!-~]+")
_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")  # visible ASCII but "%"


def check(value: str, where: str = "X-Request-Id") -> str | None:
    """Why ``value`` cannot be a request id given as ``where`` (a header or metadata), or None."""
    if not value:
        return f"{where} must not be empty"
    if not _WORD.fullmatch(value):
        return f"{where} {value[:64]!r} must be visible ASCII characters without spaces"
    return None


def conflict(given: str, rid: str, where: str = "X-Request-Id") -> str:
    """The error for a request whose ``where`` id and body ``rid`` differ."""
    return f"{where} {given!r} and the request's rid {rid!r} differ; give one, or the same in both"


def header_value(rid: str) -> str:
    """``rid`` as an ``X-Request-Id`` value: itself when it is visible ASCII, else percent-encoded UTF-8."""
    return rid if _WORD.fullmatch(rid) else quote(rid, safe=_SAFE)
