"""A scheduler's disaggregation mode and a request's part (the wire's ``DisaggRole``)."""

from __future__ import annotations

import enum

# --disaggregation-mode: what a scheduler offers the tokenizer's router ("null": both parts).
MODES = ("null", "prefill", "decode")


class Role(enum.IntEnum):
    """Values equal ``disagg_pb2.DisaggRole`` so the wire mapping is the identity."""

    NONE = 0
    PREFILL = 1
    DECODE = 2
