"""Input bounds that refuse an oversized request before any rendering or tokenization.

A prompt must leave room for one completion token, so it may hold at most
``context_length - 1`` tokens. One token of a vocabulary stands for at most
``chars_per_token`` characters of the client's text (derived below), so a text of more than
``(context_length - 1) * chars_per_token`` characters has more tokens than that whatever it
holds: it is refused at once, in O(1), with the ``context_length_exceeded`` error the
tokenizer gives after tokenizing (gRPC INVALID_ARGUMENT, HTTP 400), naming the bound.

Derivation of ``chars_per_token`` from the loaded ``tokenizer.json`` (HF ``tokenizers``
pipeline: added-token split, normalizer, pre-tokenizer, model; the post-processor only adds):

- a model token covers one piece of the pre-tokenized, normalized text, at most ``P``
  characters long, where ``P`` is the longest piece in the vocabulary (byte-level BPE pieces
  are one character per byte, and a character is at least one byte, so a piece of ``P``
  bytes covers at most ``P`` characters); an added token covers its content, ``A``
  characters;
- the pre-tokenizer must drop nothing (a ``Whitespace`` or ``Removed``-behaviour split
  deletes text, so no bound follows);
- the normalizer may shrink the text by a factor ``F``: 1 for those that never produce fewer
  characters than they read; 4 for NFC and 18 for NFKC (a text of n characters has a
  decomposition of at least n; its NFC form of m characters decomposes to at most
  ``4 * m``, the longest canonical decomposition of one character (U+1F82 and others);
  for NFKC the longest compatibility decomposition, 18 (U+FDFA)); ``len(s) / len(c)`` for a
  literal replacement of s by c; none for anything that can delete text (Strip, BertNormalizer,
  Precompiled, a regex or empty replacement);
- an unknown token must cover one character at most: a BPE without ``unk_token``, or
  with ``byte_fallback`` and all 256 ``<0xNN>`` pieces, or without ``fuse_unk``; a Unigram
  model with byte fallback. WordPiece and WordLevel map a whole word to one unknown token.

Then ``chars_per_token = F * max(P, A)``; where no bound follows (``None``) only the
message-count and id-count bounds apply and a warning at start-up says why. For SmolLM2
(byte-level BPE, no normalizer) it is 81 (a newline and 80 spaces): 8191 * 81 = 663,471
characters.

Chat: the bound applies to the text of every message (content, text parts, reasoning,
tool-call arguments), which a chat template writes into the prompt; a template that drops
some of it (earlier turns' reasoning) may see a chat refused that would fit once dropped.
Every message costs at least one token of its own (a role header or separator), so more
than ``context_length - 1`` messages cannot fit either. Ids: a prompt of ``context_length``
input ids or more, a Detokenize of more than ``context_length`` ids, and a TokenPieces of
more ids than the vocabulary holds (each id once is the whole vocabulary) are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ringserve.v1 import tokenizer_pb2
from services.tokenizer.errors import CONTEXT_LENGTH_EXCEEDED, INVALID_VALUE, RequestError, invalid
from services.tokenizer.model import ModelFacts
from services.tokenizer.sampling import context_overflow_message

# Normalizers that never return fewer characters than they read, and the most characters one
# output character of the composing ones can stand for (see the module docstring).
_NON_SHRINKING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"})
_COMPOSING_NORMALIZERS = {"NFC": 4, "NFKC": 18}
# Pre-tokenizers that only split (or map characters one to one); others may drop text.
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"})
_BYTE_PIECES = frozenset(f"<0x{b:02X}>" for b in range(256))


class NoBound(Exception):
    """The vocabulary gives no character bound (the message says which part and why)."""


def _state(component: Any) -> dict | None:
    """One pipeline component's ``tokenizer.json`` entry (its pickled state), or None."""
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_factor(spec: dict | None) -> int:
    """How many characters of input one normalized character may stand for (``F``)."""
    if spec is None:
        return 1
    kind = spec["type"]
    if kind == "Sequence":
        factor = 1
        for part in spec["normalizers"]:
            factor *= _normalizer_factor(part)
        return factor
    if kind in _NON_SHRINKING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return _COMPOSING_NORMALIZERS[kind]
    if kind == "Replace" and "String" in spec["pattern"] and spec["content"]:
        return max(1, -(-len(spec["pattern"]["String"]) // len(spec["content"])))
    raise NoBound(f"its normalizer {kind} may delete text")


def _check_pre_tokenizer(spec: dict | None) -> None:
    if spec is None:
        return
    kind = spec["type"]
    if kind == "Sequence":
        for part in spec["pretokenizers"]:
            _check_pre_tokenizer(part)
        return
    if kind not in _KEEPING_PRE_TOKENIZERS or spec.get("behavior") == "Removed":
        raise NoBound(f"its pre-tokenizer {kind} drops text")


def _check_unknown(backend: Any) -> None:
    model = backend.model
    kind = type(model).__name__
    byte_fallback = getattr(model, "byte_fallback", False) and all(
        backend.token_to_id(piece) is not None for piece in _BYTE_PIECES)
    if kind == "BPE" and (model.unk_token is None or byte_fallback or not model.fuse_unk):
        return
    if kind == "Unigram" and byte_fallback:
        return
    raise NoBound(f"its {kind} model may cover any run of unknown characters with one token")


def chars_per_token(backend: Any) -> int:
    """The most characters of client text one token of ``backend`` stands for (module docstring).

    Args:
        backend: a ``tokenizers.Tokenizer`` (a transformers tokenizer's ``backend_tokenizer``).

    Raises:
        NoBound: the vocabulary's pipeline can delete text or fuse unknown characters.
    """
    _check_pre_tokenizer(_state(backend.pre_tokenizer))
    _check_unknown(backend)
    added = backend.get_added_tokens_decoder().values()
    if any(t.lstrip or t.rstrip for t in added):
        raise NoBound("an added token strips the whitespace around it")
    # id_to_token over the ids is twice as fast as get_vocab's dict (0.7 s for 262k pieces).
    pieces = (backend.id_to_token(i) or "" for i in range(backend.get_vocab_size(with_added_tokens=False)))
    longest = max(max(map(len, pieces), default=0), max((len(t.content) for t in added), default=0))
    return _normalizer_factor(_state(backend.normalizer)) * longest


def chat_text_chars(chat: tokenizer_pb2.ChatInput) -> int:
    """Characters of message text in ``chat``: content, text parts, reasoning, tool-call arguments."""
    total = 0
    for msg in chat.messages:
        total += len(msg.content) + len(msg.reasoning_content)
        total += sum(len(part.text) for part in msg.content_parts)
        total += sum(len(call.function_arguments) for call in msg.tool_calls)
    return total


@dataclass(frozen=True)
class InputBounds:
    """The bounds of one model (see the module docstring); each check raises ``RequestError``.

    Attributes:
        context_length: the model's context window, in tokens.
        vocab_size: ids are in [0, vocab_size).
        chars_per_token: the most characters one token stands for; None: no character bound.
    """

    context_length: int
    vocab_size: int
    chars_per_token: int | None

    @classmethod
    def of(cls, tokenizer: Any, facts: ModelFacts) -> tuple[InputBounds, str | None]:
        """The bounds of ``tokenizer`` and ``facts``, and why there is no character bound (or None)."""
        try:
            return cls(facts.context_length, facts.vocab_size, chars_per_token(tokenizer.backend_tokenizer)), None
        except NoBound as exc:
            return cls(facts.context_length, facts.vocab_size, None), str(exc)

    @property
    def max_prompt_tokens(self) -> int:
        return self.context_length - 1

    @property
    def max_prompt_chars(self) -> int | None:
        """Characters beyond which no text fits, or None."""
        return None if self.chars_per_token is None else self.max_prompt_tokens * self.chars_per_token

    def _chars(self, chars: int, what: str, param: str) -> None:
        bound = self.max_prompt_chars
        if bound is not None and chars > bound:
            raise invalid(
                f"This model's maximum context length is {self.context_length} tokens. However, your {what} "
                f"{chars} characters, and more than {bound} characters cannot fit ({self.max_prompt_tokens} "
                f"tokens of at most {self.chars_per_token} characters each). Please reduce the length of the "
                f"{param}.", param, CONTEXT_LENGTH_EXCEEDED)

    def _chat(self, chat: tokenizer_pb2.ChatInput) -> None:
        count = len(chat.messages)
        if count > self.max_prompt_tokens:
            raise invalid(
                f"This model's maximum context length is {self.context_length} tokens. However, you sent {count} "
                f"messages, and more than {self.max_prompt_tokens} messages cannot fit (each takes at least one "
                "token). Please reduce the number of messages.", "messages", CONTEXT_LENGTH_EXCEEDED)
        self._chars(chat_text_chars(chat), "messages have", "messages")

    def check_generate(self, req: tokenizer_pb2.GenerateReqInput) -> None:
        """Text, chat or input ids of a Generate request (the tokenizer checks the rest)."""
        if req.WhichOneof("input") == "input_ids" and len(req.input_ids.ids) > self.max_prompt_tokens:
            raise invalid(context_overflow_message(self.context_length, len(req.input_ids.ids), None, "prompt"),
                          "prompt", CONTEXT_LENGTH_EXCEEDED)
        self.check_tokenize(req)

    def check_tokenize(self, req: tokenizer_pb2.TokenizeRequest | tokenizer_pb2.GenerateReqInput) -> None:
        """Text or chat of a Tokenize (or Generate) request."""
        which = req.WhichOneof("input")
        if which == "text":
            self._chars(len(req.text), "prompt has", "prompt")
        elif which == "chat":
            self._chat(req.chat)

    def check_detokenize(self, req: tokenizer_pb2.DetokenizeRequest) -> None:
        if len(req.ids) > self.context_length:
            raise invalid(f"ids: {len(req.ids)} ids are more than this model's maximum context length of "
                          f"{self.context_length} tokens", "ids", CONTEXT_LENGTH_EXCEEDED)

    def check_token_pieces(self, req: tokenizer_pb2.TokenIds) -> None:
        if len(req.ids) > self.vocab_size:
            raise RequestError(f"ids: {len(req.ids)} ids are more than the vocabulary's {self.vocab_size} "
                               "(each id once is the whole vocabulary)", code=INVALID_VALUE, param="ids")
