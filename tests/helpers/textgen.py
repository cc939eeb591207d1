"""Seeded generator of hard multilingual strings for the detokenizer property tests."""

from __future__ import annotations

import random

ASCII_WORDS = "the quick brown fox jumps over a lazy dog while serving LLMs at scale".split()
CODE = ["def f(x):\n    return x ** 2\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
        "SELECT * FROM t WHERE id = 42;", "{\"key\": [1, 2.5, null]}", "fn main() -> i32 { 0 }",
        "<div class=\"a\">&amp;</div>", "x = y if z else w  # comment"]
HEBREW = ["שלום", "עולם", "ספר", "מים"]
ARABIC = ["مرحبا", "بالعالم", "كتاب", "ماء"]
CYRILLIC = ["Привет", "мир", "ёжик", "щука"]
MISC = ["café", "naïve", "ďábelské", "Ελληνικά", "ภาษาไทย", "हिन्दी", "日本語のテキスト", "ｶﾀｶﾅ"]
EMOJI = ["😀", "🚀", "👍", "👩", "👨", "🧑", "💻", "🔥", "❤️", "✨", "🫠", "🦀"]
ZWJ = ["👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🧑‍🚀", "👁️‍🗨️", "❤️‍🔥"]
SKIN = ["\U0001F3FB", "\U0001F3FC", "\U0001F3FD", "\U0001F3FE", "\U0001F3FF"]
FLAGS = ["🇯🇵", "🇺🇸", "🇰🇷", "🇩🇪", "🇧🇷", "🇺🇦"]
COMBINING = ["\u0301", "\u0308", "\u0323", "\u0302", "\u030A", "\u0327", "\u20DD"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "    ", "\r\n", "\u3000", "\u00a0"]


def _segment(rng: random.Random) -> str:
    r = rng.randrange(14)
    if r == 0:
        return " ".join(rng.choices(ASCII_WORDS, k=rng.randint(1, 4)))
    if r == 1:
        return "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.randint(1, 6)))
    if r == 2:
        return "".join(chr(rng.randint(0xAC00, 0xD7A3)) for _ in range(rng.randint(1, 5)))
    if r == 3:
        return rng.choice(EMOJI) + (rng.choice(SKIN) if rng.random() < 0.5 else "")
    if r == 4:
        return rng.choice(ZWJ)
    if r == 5:
        return rng.choice(FLAGS)
    if r == 6:
        return rng.choice("aeiouxyzAEO") + "".join(rng.choices(COMBINING, k=rng.randint(1, 3)))
    if r == 7:
        return " ".join(rng.choices(HEBREW + ARABIC, k=rng.randint(1, 3)))
    if r == 8:
        return rng.choice(CODE)
    if r == 9:
        return rng.choice(SPACES)
    if r == 10:
        return rng.choice(CYRILLIC + MISC)
    if r == 11:
        # Rare code points: supplementary CJK, math letters, symbols: byte-fallback material.
        return "".join(chr(rng.choice([rng.randint(0x20000, 0x2A6DF), rng.randint(0x1D400, 0x1D7FF),
                                       rng.randint(0x2600, 0x27BF), rng.randint(0x0E00, 0x0E7F)]))
                       for _ in range(rng.randint(1, 3)))
    if r == 12:
        return str(rng.randint(0, 10**rng.randint(1, 9)))
    return rng.choice(".,;:!?-—…()[]\"'«»")


def generate(n: int, seed: int) -> list[str]:
    """``n`` strings of 1-12 segments each, mixing scripts, emoji, code and whitespace."""
    rng = random.Random(seed)
    return ["".join(_segment(rng) for _ in range(rng.randint(1, 12))) for _ in range(n)]
