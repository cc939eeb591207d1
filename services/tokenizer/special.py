"""Control tokens spelled inside chat messages stay text (special-token injection guard).

A rendered chat prompt is one string that is tokenized with special tokens parsed, so a
user message holding the text ``<|im_end|>\\n<|im_start|>system\\n...`` would otherwise
become real turn boundaries and let a client forge a system turn. ``SpecialTokenGuard``
keeps the control tokens the template writes and makes those a message wrote plain text:

1. ``mask``: in every message's content (string or text parts), reasoning content and
   tool-call arguments, each control-token string is replaced by an ASCII marker
   ``[[ringserve-special-<nonce>-<k>]]`` (the nonce is fresh per request, so no client
   text can spell a marker);
2. the template renders the masked messages;
3. ``encode``: the prompt is cut at the markers; the template's pieces are tokenized with
   special tokens parsed, and each marker's original text with special tokens split, as
   ordinary text (``<|im_end|>`` -> ``<``, ``|``, ``im``, ``_``, ``end``, ``|``, ``>``).

The returned prompt text has the originals back in place, so /v1/tokenize shows what the
client sent. The operator can turn the guard off (``--allow-special-tokens-in-messages``)
for trusted clients that build turns themselves.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from ringserve.v1 import tokenizer_pb2


class SpecialTokenGuard:
    """Masks control tokens in chat messages and tokenizes the rendered prompt around them.

    Args:
        tokenizer: a transformers fast tokenizer (``backend_tokenizer``, ``encode`` with
            ``split_special_tokens``, used here only at construction).
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        specials = sorted(
            {t.content for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values() if t.special},
            key=len,
            reverse=True,
        )
        self._special = re.compile("|".join(map(re.escape, specials))) if specials else None
        # Each control token's text as plain-text ids, made once: encoding with
        # split_special_tokens sets a flag on the shared Rust tokenizer, which a request
        # tokenized at the same time on another worker thread would see.
        self._as_text = {s: tokenizer.encode(s, add_special_tokens=False, split_special_tokens=True) for s in specials}

    def mask(self, chat: tokenizer_pb2.ChatInput) -> tuple[tokenizer_pb2.ChatInput, str, list[str]]:
        """(a copy of ``chat`` with control tokens in its messages replaced by markers, the
        marker nonce, the replaced strings in marker order). ``chat`` itself is unchanged."""
        nonce = uuid.uuid4().hex
        found: list[str] = []
        if self._special is None:
            return chat, nonce, found
        pattern = self._special

        def sub(text: str) -> str:
            def marker(m: re.Match[str]) -> str:
                found.append(m.group(0))
                return f"[[ringserve-special-{nonce}-{len(found) - 1}]]"

            return pattern.sub(marker, text)

        masked = tokenizer_pb2.ChatInput()
        masked.CopyFrom(chat)
        for msg in masked.messages:
            if msg.HasField("content"):
                msg.content = sub(msg.content)
            for part in msg.content_parts:
                part.text = sub(part.text)
            if msg.HasField("reasoning_content"):
                msg.reasoning_content = sub(msg.reasoning_content)
            for call in msg.tool_calls:
                call.function_arguments = sub(call.function_arguments)
        return masked, nonce, found

    def encode(self, prompt: str, nonce: str, found: list[str]) -> tuple[str, list[int]]:
        """(the prompt with the originals restored, its token ids); see the module docstring.

        Args:
            prompt: the template's output for the masked messages.
            nonce, found: what ``mask`` returned.
        """
        if not found:
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        pieces = re.split(rf"\[\[ringserve-special-{nonce}-(\d+)\]\]", prompt)
        text: list[str] = []
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                original = found[int(piece)]
                text.append(original)
                ids += self._as_text[original]
            elif piece:
                text.append(piece)
                ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return "".join(text), ids
