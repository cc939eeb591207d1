"""N-gram proposals: prompt lookup over the request's own prompt and output.

The sequence's last ``n`` tokens (``n`` from ``max_match`` down to ``min_match``) are looked
for earlier in the same sequence; the tokens that followed the latest earlier occurrence are
the drafts (Saxena 2023, "Prompt Lookup Decoding"; the ``ngram`` proposers of SGLang and
vLLM). Text that repeats what the prompt holds -- code edits, quotes, JSON echoing keys,
tool calls naming the prompt's values -- is predicted for free; elsewhere the lookup finds
nothing and the request decodes as without speculation.
"""

from __future__ import annotations

import numpy as np

from services.scheduler.policy.req import Req

# The lookup scans at most this many of the sequence's latest tokens: a bounded host cost
# per request and step, whatever the context length.
MAX_LOOKBACK = 4096


def lookup(ids: np.ndarray, min_match: int, max_match: int, k: int) -> list[int]:
    """Up to ``k`` tokens following the latest earlier occurrence of the longest tail of ``ids``.

    Args:
        ids: int64 [L], the sequence (prompt + output).
        min_match, max_match: the tail lengths tried, longest first.
        k: most tokens returned.

    Returns:
        The drafts (possibly fewer than ``k`` where the occurrence is near the end; empty
        when no tail of ``min_match`` tokens or more occurs earlier).
    """
    n_len = len(ids)
    for n in range(min(max_match, n_len - 1), min_match - 1, -1):
        tail = ids[n_len - n :]
        # Windows starting at 0 .. L-n-1: every earlier occurrence (the tail itself excluded).
        windows = np.lib.stride_tricks.sliding_window_view(ids[: n_len - 1], n)
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest occurrence: the most recent context
            return ids[start : start + k].tolist()
    return []


class NgramProposer:
    """``proposer.Proposer`` by prompt lookup (module docstring); keeps no state.

    Args:
        min_match, max_match: tail lengths looked up (``--speculative-ngram-min-match`` /
            ``--speculative-ngram-max-match``), 1 <= min_match <= max_match.

    Raises:
        ValueError: min_match < 1 or min_match > max_match.
    """

    def __init__(self, min_match: int, max_match: int):
        if not 1 <= min_match <= max_match:
            raise ValueError(f"ngram match sizes must satisfy 1 <= min ({min_match}) <= max ({max_match})")
        self.min_match = min_match
        self.max_match = max_match

    def propose(self, reqs: list[Req], limits: list[int]) -> list[list[int]]:
        out = []
        for req, k in zip(reqs, limits, strict=True):
            ids = req.fill_ids()[-MAX_LOOKBACK:]
            out.append(lookup(np.asarray(ids, dtype=np.int64), self.min_match, self.max_match, k) if k > 0 else [])
        return out

    def forget(self, req: Req) -> None:
        """Nothing is kept per request."""
