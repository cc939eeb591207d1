"""Where an output constraint applies in a reasoning model's output.

With a reasoning parser on (the gateway's ``--reasoning-parser``) a grammar must not shape
the reasoning, yet it must apply to an answer that has none: a model may answer at once,
and a grammar that waited for ``</think>`` would then never start (the output would come
back unconstrained). So the first output token decides, as the gateway's parsers read it:

- ``DECIDING`` (no output yet): the mask is the grammar's plus the opening tag's token.
  That token opens the reasoning; any other token is the grammar's first, and the grammar
  applies from there on.
- ``REASONING``: free output, EOS included, until the output's ids end with the end tag
  (also the start state when the prompt already opened the reasoning).
- ``ACTIVE``: the grammar masks every token.

The tags come as token ids in ``GrammarSpec.opens_with`` / ``starts_after``; without
``starts_after`` the grammar is active from the first token. The opening tag must be one
token, as ``<think>`` is in every reasoning model's vocabulary: a tag spelled in several
tokens cannot be told from text by its first one (SmolLM2 spells ``<think>`` as ``<``,
``think``, ``>``, and a ``<`` allowed beside a JSON grammar's first token is what it picks
for a tool call), so with one the grammar applies from the first token.
"""

from __future__ import annotations

from collections.abc import Sequence

DECIDING, REASONING, ACTIVE = "deciding", "reasoning", "active"


class GrammarGate:
    """One request's gate state; it follows the output tokens (and survives retraction with them)."""

    def __init__(self, starts_after: tuple[int, ...] = (), opens_with: tuple[int, ...] = ()):
        self.end = starts_after
        self.start = opens_with
        if not starts_after or len(opens_with) > 1:
            self.state = ACTIVE
        else:
            self.state = DECIDING if opens_with else REASONING

    @property
    def masks(self) -> bool:
        """This position's token is masked by the grammar."""
        return self.state != REASONING

    @property
    def grammar_decides(self) -> bool:
        """This position's token is grammar text unless it opens the reasoning."""
        return self.state in (DECIDING, ACTIVE)

    @property
    def extra_token(self) -> int | None:
        """A token allowed here beside the grammar's (the opening tag), or None."""
        return self.start[0] if self.state == DECIDING else None

    def advance(self, output_ids: Sequence[int]) -> bool:
        """Follow the newest output token; True when the grammar is to consume it."""
        if self.state == ACTIVE:
            return True
        token = output_ids[-1]
        if self.state == DECIDING:
            self.state = REASONING if token == self.start[0] else ACTIVE
            return self.state == ACTIVE
        # REASONING: the end tag is not grammar input.
        n = len(self.end)
        if len(output_ids) >= n and tuple(output_ids[-n:]) == self.end:
            self.state = ACTIVE
        return False
