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

* with a ByteFallback decoder (Gemma, and Llama-2 / Mistral with their ``Strip`` step), a
  run of ``<0xXX>`` tokens decodes all or nothing: its UTF-8 text if the whole run is valid,
  else one U+FFFD per byte. So the run is tracked apart from the windows, in O(1) per byte
  token (``DecodeStatus.run``, validated incrementally past its last complete character):
  text before the run is committed when it opens; while it is valid nothing of it is
  stable (a later byte can still turn it into U+FFFDs) and it is not decoded at all; once
  its bytes can no longer be valid UTF-8 every byte is released at once as U+FFFD, as the
  full decode will have it. The run is decoded once, in the window, when a text token
  closes it: amortized O(1) per token however long the run.
"""

from __future__ import annotations

from codecs import utf_8_decode as _utf8_decode
from collections.abc import Mapping, Sequence

from tokenizers import Tokenizer

from services.detokenizer.status import REPLACEMENT, DecodeStatus

# Longest UTF-8 sequence is 4 bytes: an incomplete one holds at most 3.
MAX_INCOMPLETE_TOKENS = 3


def offset_step(
    tok: Tokenizer,
    rows: Sequence[tuple[DecodeStatus, Sequence[int], bool]],
    special_ids: frozenset[int],
    byte_ids: Mapping[int, int] | None = None,
) -> list[str]:
    """Advance every (status, new_ids, final) row by one step; return each row's stable text.

    Rows are grouped by (skip_special_tokens, spaces_between_special_tokens); the Rust
    decoder has no spaces-between option (transformers' fast tokenizers ignore it too), so
    that key only keeps groups honest if a decoder ever honours it. With ``final`` the whole
    remaining window text is returned, trailing U+FFFD included, as the full decode has it.
    ``byte_ids`` maps the ``<0xXX>`` tokens of a ByteFallback decoder to their byte (empty
    or None otherwise).
    """
    groups: dict[tuple[bool, bool], list[int]] = {}
    ends = [0] * len(rows)  # per row: where the window ends (an open byte run is left out)
    out = [""] * len(rows)
    for k, (st, ids, final) in enumerate(rows):
        start = len(st.decode_ids)
        st.decode_ids.extend(ids)
        run_start = _track_run(st, start, special_ids, byte_ids) if byte_ids and not final else None
        ends[k] = len(st.decode_ids) if run_start is None else run_start
        if run_start is not None and run_start == st.read_offset:
            out[k] = _release_bad_run(st)  # nothing to decode: the window holds only the run
            continue
        groups.setdefault((st.skip_special_tokens, st.spaces_between_special_tokens), []).append(k)
    for (skip, _spaces), members in groups.items():
        windows: list[list[int]] = []
        for k in members:
            st = rows[k][0]
            windows.append(st.decode_ids[st.surr_offset:st.read_offset])
            windows.append(st.decode_ids[st.surr_offset:ends[k]])
        texts = tok.decode_batch(windows, skip_special_tokens=skip)
        for j, k in enumerate(members):
            st, _ids, final = rows[k]
            surr_text, read_text = texts[2 * j], texts[2 * j + 1]
            if ends[k] < len(st.decode_ids):
                # A byte run opened after text: commit the text (a boundary before a byte
                # run is final), then release the run's bytes if they are already invalid.
                out[k] = _commit_text(st, read_text[len(surr_text):], ends[k]) + _release_bad_run(st)
            else:
                out[k] = _advance(tok, st, surr_text, read_text, final, special_ids)
    return out


def _track_run(st: DecodeStatus, start: int, special_ids: frozenset[int], byte_ids: Mapping[int, int]) -> int | None:
    """Walk the ids from ``start`` (this step's) and return where the byte run that the
    window ends in starts, or None. An open run always starts at ``read_offset`` between
    steps (its opening commits the text before it). Skipped specials do not close a run."""
    ids = st.decode_ids
    skip = st.skip_special_tokens
    run_start = st.read_offset if st.run else None
    for k in range(start, len(ids)):
        i = ids[k]
        if i in byte_ids:
            if run_start is None:
                run_start = k
            _feed_byte(st, byte_ids[i])
        elif not (skip and i in special_ids):
            run_start = None
            st.run.clear()
            st.run_used = 0
            st.run_bad = False
    return run_start


def _feed_byte(st: DecodeStatus, byte: int) -> None:
    st.run.append(byte)
    if not st.run_bad:
        try:
            # Validate only past the last complete character: O(1) per byte.
            st.run_used += _utf8_decode(st.run[st.run_used:], "strict", False)[1]
        except UnicodeDecodeError:
            st.run_bad = True


def _release_bad_run(st: DecodeStatus) -> str:
    """U+FFFD for each byte of an invalid open run not sent yet (the run starts at
    ``read_offset``, so its characters are the first of the uncommitted text)."""
    if not st.run_bad or len(st.run) <= st.sent_offset:
        return ""
    delta = REPLACEMENT * (len(st.run) - st.sent_offset)
    st.sent_offset = len(st.run)
    return delta


def _advance(tok: Tokenizer, st: DecodeStatus, surr_text: str, read_text: str, final: bool,
             special_ids: frozenset[int]) -> str:
    new = read_text[len(surr_text):]
    if final:
        return new[st.sent_offset:]
    if new and not new.endswith(REPLACEMENT):
        delta = new[st.sent_offset:]
        _commit(st, len(st.decode_ids))
        return delta
    pending = st.decode_ids[st.read_offset:]
    visible = [k for k, i in enumerate(pending) if not (st.skip_special_tokens and i in special_ids)]
    if new and len(visible) > MAX_INCOMPLETE_TOKENS:
        confirmed = _commit_confirmed(tok, st, surr_text, read_text, visible)
        if confirmed is not None:
            return confirmed
    safe = new.rstrip(REPLACEMENT)
    if len(safe) <= st.sent_offset:
        return ""
    delta = safe[st.sent_offset:]
    st.sent_offset = len(safe)
    return delta


def _commit_text(st: DecodeStatus, committed: str, read: int) -> str:
    """Commit ids up to ``read`` whose text past the context is ``committed``; return the unsent part."""
    delta = committed[st.sent_offset:]
    sent_beyond = max(0, st.sent_offset - len(committed))
    _commit(st, read, keep_context=not committed)
    st.sent_offset = sent_beyond
    return delta


def _commit(st: DecodeStatus, read: int, keep_context: bool = False) -> None:
    """Commit ids up to ``read``: the old read offset becomes the context start, unless
    ``keep_context`` (the committed ids have no text, e.g. only skipped specials): a
    context without text would let a ``Strip`` decoder eat the next token's leading space."""
    if not keep_context:
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
