"""The columnar layout of the batch messages, stated once: ``BatchTokenIDOutput`` (scheduler ->
detokenizer) and ``BatchStrOutput`` (detokenizer -> tokenizer) of detokenizer.proto.

A batch of n rows has

- row columns, one value per row (rids, new_token_counts, finish_reasons, ...); any but
  ``rids`` may instead be empty (a batch without logprobs may leave logprob_counts out);
- segmented columns, the rows' segments one after the other: row i's segment of
  ``output_ids`` holds ``new_token_counts[i]`` ids, of ``output_token_logprobs``
  ``logprob_counts[i]`` values, and of ``top_logprob_ids`` / ``top_logprob_vals``
  ``logprob_counts[i] * k[i]``, k[i] being the row's top logprobs per token
  (``top_logprobs_nums[i]`` in BatchStrOutput; in BatchTokenIDOutput the rid's
  ``RowInit.top_logprobs_num``, which only the detokenizer's per-rid state knows).

Writers: the scheduler's ``StepOutput`` appends rows (``policy/output.py``), the detokenizer
copies rows per tokenizer (``gather``). Readers: the tokenizer splits a BatchStrOutput into
rows and the detokenizer walks a step's ids (``split``, ``offsets``). Checker: ``check``, run
before the detokenizer touches a batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from operator import mul
from typing import Any


@dataclass(frozen=True)
class Layout:
    """One batch message's columns.

    Attributes:
        rows: the row columns besides ``rids`` (whose length is n).
        segmented: (column, count column) of the segmented columns cut by a count alone.
        top: the row column of top logprobs per token, None where the message has none
            (the top-logprob columns are cut by ``logprob_counts`` times it).
    """

    rows: tuple[str, ...]
    segmented: tuple[tuple[str, str], ...] = (("output_ids", "new_token_counts"),
                                              ("output_token_logprobs", "logprob_counts"))
    top: str | None = None


TOKEN_IDS = Layout(("tokenizer_ids", "new_token_counts", "finish_reasons", "prompt_tokens",
                    "completion_tokens", "cached_tokens", "logprob_counts"))
STR = Layout(("texts", "new_token_counts", "finish_reasons", "prompt_tokens", "completion_tokens",
              "cached_tokens", "logprob_counts", "top_logprobs_nums"), top="top_logprobs_nums")


def offsets(counts: Iterable[int], widths: Iterable[int] | None = None) -> list[int]:
    """The n + 1 offsets of a segmented column: row i's segment is ``[offsets[i], offsets[i + 1])``.

    Args:
        counts: per row, the segment's length (or count of tokens when ``widths`` is given).
        widths: per row, values per counted token (top logprobs per token).
    """
    return list(accumulate(counts if widths is None else map(mul, counts, widths), initial=0))


def split(flat: Sequence[Any], counts: Iterable[int], widths: Iterable[int] | None = None) -> list[list[Any]]:
    """Each row's segment of a flat column, a list per row (arguments as ``offsets``).

    A plain loop over the counts: on CPython 3.11 it beats a prefix sum and a comprehension
    of slices (7.6 against 10 us for 64 rows), and the column is copied to a list once because
    slicing a protobuf repeated field costs more than slicing a list.
    """
    values = list(flat)
    out = []
    at = 0
    for k in counts if widths is None else map(mul, counts, widths):
        out.append(values[at:at + k])
        at += k
    return out


def gather(flat: Sequence[Any], offs: Sequence[int], rows: Iterable[int]) -> list[Any]:
    """The segments of ``rows`` (in that order) concatenated: a subset of a batch's column.

    Args:
        flat: the segmented column; offs: its ``offsets``; rows: row indices.
    """
    return list(chain.from_iterable(flat[offs[i]:offs[i + 1]] for i in rows))


def check(batch: Any, layout: Layout, widths: Sequence[int] | None = None) -> str | None:
    """Why ``batch`` breaks ``layout``, or None when it is sound.

    Checks every row column's length (n or empty), that counts are not negative, and that each
    segmented column holds exactly its rows' segments; the top-logprob columns only where the
    row widths are known (the message's ``top`` column, or ``widths``). It runs on every step
    of the detokenizer, so it reads each column once and builds nothing.

    Args:
        batch: a message of ``layout`` (or any object with its columns, such as ``StepOutput``).
        widths: top logprobs per token of each row, when ``layout`` has no ``top`` column.
    """
    n = len(batch.rids)
    for name in layout.rows:
        got = len(getattr(batch, name))
        if got != n and got:
            return f"{name} has {got} entries for {n} rows"
    for column, count in layout.segmented:
        counts = getattr(batch, count)
        if counts and min(counts) < 0:
            return f"{count} has a negative count"
        total = sum(counts)
        if total != len(getattr(batch, column)):
            return f"{count} (sum {total}) do not cover {column} ({len(getattr(batch, column))} values)"
    if layout.top is not None and len(getattr(batch, layout.top)):
        widths = getattr(batch, layout.top)
    if widths is not None:
        total = sum(map(mul, batch.logprob_counts, widths))
        for column in ("top_logprob_ids", "top_logprob_vals"):
            if len(getattr(batch, column)) != total:
                return f"logprob_counts times {layout.top or 'the top logprobs'} (sum {total}) do not cover " \
                       f"{column} ({len(getattr(batch, column))} values)"
    return None
