"""How far a regular expression counts: the bound ringserve puts on counted repetitions.

llguidance, the default grammar engine, builds a counted repetition into lexer states one
per count: measured on SmolLM2's vocabulary, ``a{1000}`` masks in 0.5 ms a token,
``a{10000}`` in 8-13 ms (the engine loop stalls that long every step), ``(a{1000}){1000}``
spent 3.9 s on its first mask and ``a{300000}`` exceeds the engine's limits. So a regex
(the ``regex`` constraint, or a JSON schema's ``pattern`` and ``patternProperties``) may
count to at most ``MAX_REPEAT``, nested repetitions multiplied.
"""

from __future__ import annotations

import re

MAX_REPEAT = 1000
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_BRACED_ESCAPES = "pPxu"  # \p{Greek}, \x{10FFFF}, \u{..}: their braces are not a count


def _skip_escape(regex: str, i: int) -> int:
    """The index after the escape at ``regex[i]`` (a backslash)."""
    if i + 2 < len(regex) and regex[i + 1] in _BRACED_ESCAPES and regex[i + 2] == "{":
        end = regex.find("}", i + 3)
        return len(regex) if end < 0 else end + 1
    return i + 2


def _skip_class(regex: str, i: int) -> int:
    """The index after the character class opening at ``regex[i]`` (nested classes, as Rust's
    ``[a-z&&[^x]]`` and ``[[:alpha:]]``, included)."""
    i += 1
    if i < len(regex) and regex[i] == "^":
        i += 1
    if i < len(regex) and regex[i] == "]":
        i += 1  # a leading ] is a literal
    depth = 1
    while i < len(regex) and depth:
        ch = regex[i]
        if ch == "\\":
            i = _skip_escape(regex, i)
            continue
        depth += {"[": 1, "]": -1}.get(ch, 0)
        i += 1
    return i


def max_repeat(regex: str) -> int:
    """The largest count the counted repetitions of ``regex`` reach, nested ones multiplied
    (``(a{100}){100}`` -> 10,000; ``a{2,5}`` -> 5; ``a{7,}`` -> 7; 1 without any).

    A scan of the syntax the grammar engines share (Rust's regex crate, which llguidance
    follows, and the ECMAScript subset of xgrammar): escapes, character classes, groups and
    ``{n}``, ``{n,}``, ``{n,m}``. Not a validator: what it does not understand counts 1,
    and the grammar engine judges the regex.
    """
    maxima = [1]  # per open group: the largest count inside it so far
    pending = 1  # the count of the atom just read, which a quantifier may still multiply
    i = 0
    while i < len(regex):
        ch = regex[i]
        if ch == "{" and (m := _COUNT.match(regex, i)):
            pending *= max(int(m[1]), int(m[2] or 0), 1)
            i = m.end()
            continue
        if ch in "*+?":
            i += 1
            continue
        maxima[-1] = max(maxima[-1], pending)
        pending = 1
        if ch == "\\":
            i = _skip_escape(regex, i)
        elif ch == "[":
            i = _skip_class(regex, i)
        elif ch == "(":
            maxima.append(1)
            i += 2 if regex.startswith("(?", i) else 1  # a group's flags are not a quantifier
        elif ch == ")" and len(maxima) > 1:
            pending = maxima.pop()
            i += 1
        else:
            i += 1
    for inner in reversed(maxima):  # groups left open count as closed
        pending = max(inner, pending)
    return pending
