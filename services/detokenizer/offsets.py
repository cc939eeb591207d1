"""The general path: SGLang's surr/read offset algorithm, batched per step.

For a decoder that does not concatenate per-token pieces (vocab.py), each row decodes two
short windows per step, ``ids[surr:read]`` (text already committed, the context) and
``ids[surr:]``; the difference is new text. All rows of a step that share decode flags go
to one ``tokenizers.Tokenizer.decode_batch`` call (Rust, GIL released), which costs about a
quarter of transformers' Python-level ``batch_decode`` loop.

Differences from SGLang's DetokenizerManager.handle_batch_token_id_out:

* the printable prefix released without committing is "everything before the trailing
  U+FFFD run" (exact for lossy UTF-8), not TextStreamer's word heuristic, and it is tracked
  by ``sent_offset`` so it is never sent twice;
* a window that still ends in U+FFFD with 4 or more visible tokens pending cannot be an
  incomplete character (at most 3 bytes, each token at least one byte): it is committed up
  to the last boundary whose text the window confirms, so an invalid byte does not stall
  the stream nor grow the window;
* the window is cut back to ``ids[surr:]`` at every commit, so per-token work is bounded.

* with a ByteFallback decoder, a window that ends in a ``<0xXX>`` token is left open: the
  run decodes all or nothing, so nothing of it is stable until a text token closes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from services.detokenizer.status import REPLACEMENT, DecodeStatus

# Longest UTF-8 sequence is 4 bytes: an incomplete one holds at most 3.
MAX_INCOMPLETE_TOKENS = 3


def offset_step(
    tok: Tokenizer,
    rows: Sequence[tuple[DecodeStatus, Sequence[int], bool]],
    special_ids: frozenset[int],
    byte_ids: frozenset[int] = frozenset(),
) -> list[str]:
    """Advance every (status, new_ids, final) row by one step; return each row's stable text.

    Rows are grouped by (skip_special_tokens, spaces_between_special_tokens); the Rust
    decoder has no spaces-between option (transformers' fast tokenizers ignore it too), so
    that key only keeps groups honest if a decoder ever honours it. With ``final`` the whole
    remaining window text is returned, trailing U+FFFD included, as the full decode has it.
    ``byte_ids`` are the ``<0xXX>`` tokens of a ByteFallback decoder (empty otherwise).
    """
    groups: dict[tuple[bool, bool], list[int]] = {}
    for k, (st, ids, _final) in enumerate(rows):
        st.decode_ids.extend(ids)
        groups.setdefault((st.skip_special_tokens, st.spaces_between_special_tokens), []).append(k)
    out = [""] * len(rows)
    for (skip, _spaces), members in groups.items():
        windows: list[list[int]] = []
        for k in members:
            st = rows[k][0]
            windows.append(st.decode_ids[st.surr_offset:st.read_offset])
            windows.append(st.decode_ids[st.surr_offset:])
        texts = tok.decode_batch(windows, skip_special_tokens=skip)
        for j, k in enumerate(members):
            st, _ids, final = rows[k]
            out[k] = _advance(tok, st, texts[2 * j], texts[2 * j + 1], final, special_ids, byte_ids)
    return out


def _advance(tok: Tokenizer, st: DecodeStatus, surr_text: str, read_text: str, final: bool,
             special_ids: frozenset[int], byte_ids: frozenset[int]) -> str:
    new = read_text[len(surr_text):]
    if final:
        return new[st.sent_offset:]
    if byte_ids:
        run_start = _open_run_start(st, special_ids, byte_ids)
        if run_start is not None:
            # ByteFallback decodes a run of <0xXX> tokens all or nothing (valid UTF-8, else
            # one U+FFFD per byte), so nothing of an open run is stable: commit only up to
            # the run (a boundary after a text token is final) and keep the run open.
            if run_start <= st.read_offset:
                return ""
            text = tok.decode(st.decode_ids[st.surr_offset:run_start], skip_special_tokens=st.skip_special_tokens)
            return _commit_text(st, text[len(surr_text):], run_start)
    if new and not new.endswith(REPLACEMENT):
        delta = new[st.sent_offset:]
        _commit(st, len(st.decode_ids))
        return delta
    pending = st.decode_ids[st.read_offset:]
    visible = [k for k, i in enumerate(pending) if not (st.skip_special_tokens and i in special_ids)]
    if new and len(visible) > MAX_INCOMPLETE_TOKENS:
        delta = _commit_confirmed(tok, st, surr_text, read_text, visible)
        if delta is not None:
            return delta
    safe = new.rstrip(REPLACEMENT)
    if len(safe) <= st.sent_offset:
        return ""
    delta = safe[st.sent_offset:]
    st.sent_offset = len(safe)
    return delta


def _open_run_start(st: DecodeStatus, special_ids: frozenset[int], byte_ids: frozenset[int]) -> int | None:
    """Start of the run of byte tokens the window ends in, or None (skipped specials do not
    close a run). Only the uncommitted ids are searched: commits never split a run."""
    ids = st.decode_ids
    skip = st.skip_special_tokens
    k = len(ids)
    saw_byte = False
    while k > st.read_offset and (ids[k - 1] in byte_ids or (skip and ids[k - 1] in special_ids)):
        saw_byte = saw_byte or ids[k - 1] in byte_ids
        k -= 1
    if not saw_byte:
        return None
    while k < len(ids) and ids[k] not in byte_ids:  # leading skipped specials are not the run
        k += 1
    return k


def _commit_text(st: DecodeStatus, committed: str, read: int) -> str:
    """Commit ids up to ``read`` whose text past the context is ``committed``; return the unsent part."""
    delta = committed[st.sent_offset:]
    sent_beyond = max(0, st.sent_offset - len(committed))
    _commit(st, read)
    st.sent_offset = sent_beyond
    return delta


def _commit(st: DecodeStatus, read: int) -> None:
    """Commit ids up to ``read``: the old read offset becomes the context start."""
    st.surr_offset = st.read_offset
    st.read_offset = read
    st.sent_offset = 0
    # Cut the window so the next decode starts at the context: bounded work per token.
    del st.decode_ids[: st.surr_offset]
    st.read_offset -= st.surr_offset
    st.surr_offset = 0


def _commit_confirmed(tok: Tokenizer, st: DecodeStatus, surr_text: str, read_text: str,
                      visible: list[int]) -> str | None:
    """Commit through a genuine U+FFFD: the largest boundary whose text is final.

    A boundary is final when its text does not end in U+FFFD, or when at least 3 visible
    tokens follow it and the window's text starts with it (the bytes after it decided the
    fate of any incomplete sequence). Rare: only after invalid bytes.
    """
    n = len(st.decode_ids)
    limit = st.read_offset + visible[-MAX_INCOMPLETE_TOKENS]  # ≥ 3 visible tokens after it
    for end in range(n - 1, st.read_offset, -1):
        text = tok.decode(st.decode_ids[st.surr_offset:end], skip_special_tokens=st.skip_special_tokens)
        if len(text) <= len(surr_text):
            continue
        if not text.endswith(REPLACEMENT) or (end <= limit and read_text.startswith(text)):
            return _commit_text(st, text[len(surr_text):], end)
    return None
