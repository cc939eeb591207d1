"""Per-token byte tables for the detokenizer's fast path, verified against the tokenizer.

Most LLM vocabularies decode a sequence of ids by mapping each id to a piece and
concatenating the pieces; then the text of a stream can be built incrementally, without
re-decoding a window, from a table ``id -> piece``. Two decoder kinds qualify:

* byte-level BPE (GPT-2 style, ``decoders.ByteLevel``): every token maps to bytes, and the
  text is ``bytes(concat).decode("utf-8", "replace")``. Rust's ``String::from_utf8_lossy``
  and Python's ``errors="replace"`` both substitute one U+FFFD per maximal invalid subpart
  (Unicode 15, §3.9 "U+FFFD Substitution of Maximal Subparts"), so an incremental Python
  decoder reproduces the Rust decode exactly.
* SentencePiece-style BPE with byte fallback (``Replace("▁", " ")``, ``ByteFallback``,
  ``Fuse``; no ``Strip``): text tokens map to strings; ``<0xXX>`` tokens are raw bytes, and a
  run of consecutive byte tokens decodes as one unit — its UTF-8 text if the whole run is
  valid, otherwise one U+FFFD per byte of the run (tokenizers' ``ByteFallback``).

A table is only used after it has been checked against the tokenizer itself: every id's
piece must decode like ``decode([id])`` (with and without ``skip_special_tokens``), and
random id sequences biased to byte tokens and special tokens must decode like
``decode_batch``. Anything else (a ``Strip`` decoder, WordPiece, a piece that does not
verify) is left to the general offset algorithm (``offsets.py``).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from ringserve.modelfacts import tokenizer_vocab_size
from ringserve.token_bytes import byte_level_bytes, byte_token_value

log = logging.getLogger(__name__)

BYTE_LEVEL = "byte_level"
BYTE_FALLBACK = "byte_fallback"


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` from a model directory (or the file itself).

    Raises:
        FileNotFoundError: there is no tokenizer.json at that path.
    """
    path = Path(model_dir)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {model_dir}")
    return Tokenizer.from_file(str(path))


@dataclass(frozen=True)
class ByteTable:
    """A verified id -> piece table.

    Attributes:
        kind: BYTE_LEVEL or BYTE_FALLBACK.
        pieces_keep: per id, the piece with special tokens kept: ``bytes`` for BYTE_LEVEL;
            for BYTE_FALLBACK a ``str`` for text tokens and an ``int`` (0..255) for byte tokens.
        pieces_skip: the same with special tokens mapped to ``b""`` (BYTE_LEVEL) or ``None``
            (BYTE_FALLBACK: a skipped special token does not close a byte run, as in
            tokenizers, which filters the ids before decoding).
        vocab_size: number of ids (len of each table).
    """

    kind: str
    pieces_keep: list
    pieces_skip: list
    vocab_size: int

    def reference_decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """Decode ``ids`` in one go from the table (what the streamed text must add up to)."""
        pieces = self.pieces_skip if skip_special_tokens else self.pieces_keep
        if self.kind == BYTE_LEVEL:
            return b"".join(pieces[i] for i in ids).decode("utf-8", "replace")
        out: list[str] = []
        run = bytearray()
        for i in ids:
            p = pieces[i]
            if p is None:
                continue
            if isinstance(p, int):
                run.append(p)
                continue
            if run:
                out.append(_close_run(run))
                run.clear()
            out.append(p)
        if run:
            out.append(_close_run(run))
        return "".join(out)


def _close_run(run: bytes | bytearray) -> str:
    """tokenizers' ByteFallback: a valid run is its text, else one U+FFFD per byte."""
    try:
        return bytes(run).decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(run)


def _special_ids(tok: Tokenizer) -> set[int]:
    return {i for i, t in tok.get_added_tokens_decoder().items() if t.special}


def _decoder_spec(tok: Tokenizer) -> dict:
    """The decoder's tokenizer.json entry ({} without one). Serialized from the decoder alone
    (its pickled state is that JSON): ``tok.to_str()`` would write and parse the whole
    tokenizer, seconds for a 262k vocabulary."""
    return {} if tok.decoder is None else json.loads(tok.decoder.__getstate__())


def _decoder_kind(tok: Tokenizer) -> tuple[str | None, list[tuple[str, str]]]:
    """Classify the decoder from tokenizer.json: (kind or None, Replace rules to apply)."""
    spec = _decoder_spec(tok)
    if spec.get("type") == "ByteLevel":
        return BYTE_LEVEL, []
    if spec.get("type") != "Sequence":
        return None, []
    replaces: list[tuple[str, str]] = []
    seen_fallback = False
    for d in spec.get("decoders", []):
        kind = d.get("type")
        if kind == "Replace" and "String" in d.get("pattern", {}) and not seen_fallback:
            replaces.append((d["pattern"]["String"], d["content"]))
        elif kind == "ByteFallback" and not seen_fallback:
            seen_fallback = True
        elif kind == "Fuse":
            continue
        else:
            # Strip (leading-space removal at sequence start), regex Replace, ... do not
            # concatenate per token.
            return None, []
    return (BYTE_FALLBACK if seen_fallback else None), replaces


def byte_fallback_ids(tok: Tokenizer) -> dict[int, int]:
    """Id -> byte value of the ``<0xXX>`` tokens when the decoder has a ByteFallback step,
    else empty."""
    if '"ByteFallback"' not in json.dumps(_decoder_spec(tok)):
        return {}
    vocab = tok.get_vocab(with_added_tokens=False)
    return {i: b for t, i in vocab.items() if (b := byte_token_value(t)) is not None}


def build_byte_table(tok: Tokenizer, seed: int = 0) -> ByteTable | None:
    """Build and verify the fast-path table for ``tok``; None when it does not qualify.

    Cost: one ``decode_batch`` over every id twice (both skip flags) plus a few hundred
    random sequences; about 0.5 s for a 262k vocabulary on one core.

    Returns:
        The table, or None (logged with the reason) when the decoder is not a
        concatenating kind or any check against the tokenizer fails.
    """
    kind, replaces = _decoder_kind(tok)
    if kind is None:
        log.info("decoder does not concatenate per-token pieces; using the offset algorithm")
        return None
    size = tokenizer_vocab_size(tok)
    special = _special_ids(tok)
    keep: list = [None] * size
    if kind == BYTE_LEVEL:
        for i in range(size):
            token = tok.id_to_token(i)
            if token is None:
                log.info("id %d has no token; using the offset algorithm", i)
                return None
            # tokenizers' ByteLevel decoder keeps a token with a character outside the byte
            # map (an added token such as "  ") as its UTF-8 text.
            raw = byte_level_bytes(token)
            keep[i] = token.encode("utf-8") if raw is None else raw
        skip = [b"" if i in special else p for i, p in enumerate(keep)]
    else:
        for i in range(size):
            token = tok.id_to_token(i)
            if token is None:
                log.info("id %d has no token; using the offset algorithm", i)
                return None
            byte = byte_token_value(token)
            if byte is not None:
                keep[i] = byte
            else:
                for pattern, content in replaces:
                    token = token.replace(pattern, content)
                keep[i] = token
        skip = [None if i in special else p for i, p in enumerate(keep)]
    table = ByteTable(kind, keep, skip, size)
    return table if _verify(tok, table, special, seed) else None


def _verify(tok: Tokenizer, table: ByteTable, special: set[int], seed: int) -> bool:
    """Check the table against ``tok``: every single id, then random sequences."""
    size = table.vocab_size
    singles = [[i] for i in range(size)]
    for skip in (False, True):
        got = tok.decode_batch(singles, skip_special_tokens=skip)
        for i, text in enumerate(got):
            if text != table.reference_decode([i], skip):
                log.warning("id %d decodes to %r, table gives %r; using the offset algorithm",
                            i, text, table.reference_decode([i], skip))
                return False
    rng = random.Random(seed)
    pieces = table.pieces_keep
    if table.kind == BYTE_LEVEL:
        short = [i for i in range(size) if len(pieces[i]) == 1]
    else:
        short = [i for i in range(size) if isinstance(pieces[i], int)]
    specials = sorted(special) or [0]
    seqs = []
    for _ in range(400):
        seq = []
        for _ in range(rng.randint(1, 24)):
            r = rng.random()
            seq.append(rng.choice(short) if r < 0.5 else rng.choice(specials) if r < 0.6 else rng.randrange(size))
        seqs.append(seq)
    for skip in (False, True):
        for seq, text in zip(seqs, tok.decode_batch(seqs, skip_special_tokens=skip), strict=True):
            if text != table.reference_decode(seq, skip):
                log.warning("ids %s decode to %r, table gives %r; using the offset algorithm",
                            seq, text, table.reference_decode(seq, skip))
                return False
    return True
