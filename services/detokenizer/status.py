"""Per-request decode state (``DecodeStatus``) and the text it releases each step.

The algorithm follows SGLang's DetokenizerManager (``DecodeStatus`` with surr/read offsets,
itself vLLM's incremental detokenization), with fixes for the field failures of
docs/cases.md (split characters, SentencePiece spaces, stop prefixes). Per rid:

* ``decode_ids[surr_offset:read_offset]`` is the committed context window (token
  coordinates) and ``decode_ids[read_offset:]`` the ids not yet committed. Each step decodes
  ``ids[surr:read]`` and ``ids[surr:]`` and commits the difference when it does not end in an
  incomplete character (U+FFFD); otherwise only the printable prefix before the trailing
  U+FFFD run is released and nothing is committed. ``sent_offset`` (character coordinate)
  counts the characters of the uncommitted text already released, so none is sent twice.
  ``decode_ids`` is cut back to the window on every commit (offsets.py).
* With a verified ``ByteTable`` (vocab.py) the same contract is met without windows: each
  id maps to its piece, and the text is built incrementally — byte-level BPE through the C
  UTF-8 decoder with at most 3 bytes of an incomplete character pending; SentencePiece byte
  fallback through a byte-run accumulator. This is the fast path (the manager inlines its
  common case over a whole step).
* ``held`` is committed text not yet sent because it is a proper prefix of one of the
  request's stop strings. Sent text itself is never kept: the tokenizer owns it, so a state
  stays a few bytes however long the output grows.

Guarantees (tests/detokenizer/test_properties.py and test_cases.py check each, exactly, on
SmolLM2, Qwen2.5, Gemma 3 and Gemma 3 behind a Llama-2-style ``Strip`` decoder):

1. Text only moves forward: nothing is sent twice or out of order (the offsets never move
   back); every delta is a ``str`` without surrogates, so it encodes as valid UTF-8.
2. When the request ends, the concatenated deltas equal ``tokenizer.decode(output_ids,
   skip_special_tokens=...)`` (less the trimmed stop), whatever the split of ids into steps.
3. U+FFFD is sent only where the full decode has one. What is held back for an incomplete
   character is bounded: at most 3 bytes (so at most 3 tokens) for byte-level BPE; for byte
   fallback, a valid open run of ``<0xXX>`` tokens, because tokenizers decodes such a run all
   or nothing — and both paths release a run, one U+FFFD per byte, the moment its bytes can
   no longer be valid UTF-8, at O(1) cost per byte token. A token that truly decodes to
   U+FFFD is committed and the text after it keeps streaming.
4. Per-token work does not grow with the output: no window grows, no string is appended to.
5. At finish the matched stop is trimmed unless ``no_stop_trim`` (a stop string: the unsent
   text is cut at its first occurrence; a stop token id: that token is not decoded), the
   unsent tail is flushed, and the caller deletes the state.
6. Stop strings: while running, only the trailing characters that are a proper prefix of a
   stop string are held (at most ``len(longest stop) - 1``), and they are released as soon
   as they can no longer grow into a match, or at the end for any other finish reason.

The first output ids are decoded in the context of the prompt tail: for a decoder that
strips a leading space at the start of a sequence (SentencePiece ``Strip``), the offset
algorithm starts its window on prompt ids so a first token "▁word" keeps its space (C02).
The fast path needs no context: it only serves decoders that map "▁" to a space per token.
"""

from __future__ import annotations

from codecs import utf_8_decode as _utf8_decode

from services.detokenizer.vocab import BYTE_LEVEL, ByteTable

REPLACEMENT = "\ufffd"


class DecodeStatus:
    """Decode state of one rid. Create with ``fast_status`` or ``offset_status``."""

    __slots__ = (
        "rid", "tokenizer_id", "skip_special_tokens", "spaces_between_special_tokens",
        "no_stop_trim", "top_logprobs_num", "stops", "max_hold", "held",
        # fast path
        "pieces", "byte_level", "pending", "run", "run_used", "run_bad",
        # offset path
        "decode_ids", "surr_offset", "read_offset", "sent_offset",
    )

    def __init__(self, rid: str, tokenizer_id: str, skip_special_tokens: bool,
                 spaces_between_special_tokens: bool, no_stop_trim: bool,
                 top_logprobs_num: int, stop: list[str] | tuple[str, ...]) -> None:
        self.rid = rid
        self.tokenizer_id = tokenizer_id
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.no_stop_trim = no_stop_trim
        self.top_logprobs_num = top_logprobs_num
        self.stops = tuple(s for s in stop if s)
        self.max_hold = max((len(s) for s in self.stops), default=1) - 1
        self.held = ""
        self.pieces: list | None = None
        self.byte_level = False
        # Bytes of an incomplete character (byte-level). Between steps the manager keeps
        # them in its own rid -> bytes map so its vectorized step can see them at once.
        self.pending = b""
        self.run = bytearray()
        self.run_used = 0  # bytes of the run known to be complete valid characters
        self.run_bad = False
        self.decode_ids: list[int] = []
        self.surr_offset = 0
        self.read_offset = 0
        # Characters of the uncommitted window text already sent (SGLang's sent_offset,
        # counted from the read offset so it never needs the whole text).
        self.sent_offset = 0

    # ---- fast path -------------------------------------------------------------------

    def fast_step(self, ids, final: bool) -> str:
        """Text that became stable after ``ids`` (a sequence of int token ids).

        With ``final`` the held incomplete bytes are flushed (as U+FFFD, like the full
        decode). Raises IndexError for an id outside the vocabulary.
        """
        pieces = self.pieces
        assert pieces is not None  # made by fast_status
        if self.byte_level:
            data = self.pending + b"".join([pieces[i] for i in ids])
            # The C decoder behind codecs' incremental decoder: an incomplete trailing
            # sequence is left unconsumed (at most 3 bytes), invalid bytes become U+FFFD.
            text, used = _utf8_decode(data, "replace", final)
            self.pending = data[used:]
            return text
        out: list[str] = []
        run = self.run
        for i in ids:
            p = pieces[i]
            if p is None:  # skipped special token: invisible, does not close a byte run
                continue
            if p.__class__ is int:
                if self.run_bad:
                    # The run is already invalid, so the whole run decodes to one U+FFFD
                    # per byte whatever follows: release each at once.
                    out.append(REPLACEMENT)
                    continue
                run.append(p)
                try:
                    # Validate only past the last complete character: bounded work per byte.
                    self.run_used += _utf8_decode(run[self.run_used:], "strict", False)[1]
                except UnicodeDecodeError:
                    self.run_bad = True
                    out.append(REPLACEMENT * len(run))
                continue
            if run:
                out.append(self._close_run())
            out.append(p)
        if final and run:
            out.append(self._close_run())
        return "".join(out)

    def _close_run(self) -> str:
        """Close the open byte run: its text if valid and complete, else U+FFFD per byte."""
        run = self.run
        text = ""
        if not self.run_bad:
            try:
                text = run.decode("utf-8")
            except UnicodeDecodeError:
                text = REPLACEMENT * len(run)
        run.clear()
        self.run_used = 0
        self.run_bad = False
        return text

    # ---- stop strings and release ----------------------------------------------------

    def release(self, text: str) -> str:
        """Send ``text`` (stable, while running), holding back a trailing stop-string prefix."""
        if not self.stops:
            return text
        text = self.held + text
        n = len(text)
        cut = n
        # The earliest start wins: it is the longest suffix that could still become a stop.
        for p in range(max(0, n - self.max_hold), n):
            suffix = text[p:]
            if any(len(s) > len(suffix) and s.startswith(suffix) for s in self.stops):
                cut = p
                break
        self.held = text[cut:]
        return text[:cut]

    def finish(self, text: str, matched_str: str | None) -> str:
        """Last delta: held text plus ``text``, cut at the first occurrence of the matched stop."""
        text = self.held + text
        self.held = ""
        if matched_str and not self.no_stop_trim:
            at = text.find(matched_str)
            if at >= 0:
                text = text[:at]
        return text


def fast_status(table: ByteTable, **fields) -> DecodeStatus:
    """A DecodeStatus on the fast path of ``table`` (fields as in ``DecodeStatus``)."""
    st = DecodeStatus(**fields)
    st.pieces = table.pieces_skip if st.skip_special_tokens else table.pieces_keep
    st.byte_level = table.kind == BYTE_LEVEL
    return st


def offset_status(context_ids: list[int], **fields) -> DecodeStatus:
    """A DecodeStatus on the offset path whose window starts on ``context_ids`` (prompt tail)."""
    st = DecodeStatus(**fields)
    st.decode_ids = list(context_ids)
    st.surr_offset = 0
    st.read_offset = len(context_ids)
    return st
