"""How vocabularies spell raw bytes in their token strings (pieces).

- Byte-level BPE (GPT-2, Llama 3, Qwen2.5, SmolLM2): every byte is one printable character,
  GPT-2's reversible ``bytes_to_unicode`` map (openai/gpt-2 ``encoder.py``): the 188 bytes
  that are printable Latin-1 stand for themselves, the other 68 take U+0100 upwards in byte
  order (the space 0x20 is ``Ġ``, U+0120). A piece's bytes are its characters mapped back.
- Byte fallback (SentencePiece: Llama 2, Gemma): a byte the vocabulary has no piece for is
  the token ``<0xNN>`` (two hex digits, upper case in every vocabulary seen).

The tokenizer service uses these to report a token's raw bytes (``TokenPieces``) and to tell
whether a vocabulary can spell every byte; the detokenizer builds its per-token byte tables
from them.
"""

from __future__ import annotations


def _gpt2_byte_to_char() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update((b, chr(256 + i)) for i, b in enumerate(others))
    return dict(sorted(table.items()))


# GPT-2's byte -> character map (256 entries) and its inverse.
BYTE_TO_CHAR: dict[int, str] = _gpt2_byte_to_char()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}

# The 256 byte-fallback tokens as vocabularies spell them.
BYTE_TOKENS: frozenset[str] = frozenset(f"<0x{b:02X}>" for b in range(256))

_HEX = frozenset("0123456789abcdefABCDEF")


def byte_level_bytes(piece: str) -> bytes | None:
    """The bytes a byte-level BPE piece stands for, or None when a character of it is outside
    GPT-2's map (an added token such as ``"<|im_end|>"`` written as plain text)."""
    try:
        return bytes(CHAR_TO_BYTE[c] for c in piece)
    except KeyError:
        return None


def byte_token_value(piece: str) -> int | None:
    """The byte of a byte-fallback token ``<0xNN>`` (either case of hex digit), else None."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">") and _HEX.issuperset(piece[3:5]):
        return int(piece[3:5], 16)
    return None
