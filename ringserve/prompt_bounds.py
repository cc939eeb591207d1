"""Prompt bounds that refuse an oversized request before any rendering or tokenization.

A prompt must leave room for one completion token, so it may hold at most
``context_length - 1`` tokens. When one token of the vocabulary stands for at most
``chars_per_token`` characters of the client's text (the tokenizer derives it from the loaded
vocabulary: ``services.tokenizer.bounds``), a text of more than
``(context_length - 1) * chars_per_token`` characters has more tokens than that whatever it
holds: it is refused at once, in O(1), with the ``context_length_exceeded`` error the
tokenizer gives after tokenizing, naming the bound. The tokenizer applies these checks to
every RPC; the gateway (which gets ``chars_per_token`` in ``ModelInfo``) to every request
before it encodes and sends it, so a 15 MB prompt costs neither service more than parsing.

Chat: the bound applies to the text of every message (content, text parts, reasoning,
tool-call arguments), which a chat template writes into the prompt; a template that drops
some of it (earlier turns' reasoning) may see a chat refused that would fit once dropped.
Every message costs at least one token of its own (a role header or separator), so more
than ``context_length - 1`` messages cannot fit either. Ids: a prompt of ``context_length``
input ids or more, a Detokenize of more than ``context_length`` ids, and a TokenPieces of
more ids than the vocabulary holds (each id once is the whole vocabulary) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.v1 import tokenizer_pb2

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
INVALID_VALUE = "invalid_value"


class BoundExceeded(ValueError):
    """A request over a bound: the message, the OpenAI parameter and the error code."""

    def __init__(self, message: str, param: str, code: str = CONTEXT_LENGTH_EXCEEDED) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def context_overflow_message(context_length: int, prompt_len: int, max_new_tokens: int | None, what: str) -> str:
    """OpenAI's wording; ``what`` is "messages" or "prompt"."""
    head = f"This model's maximum context length is {context_length} tokens. However, "
    if max_new_tokens is None:
        return (
            head + f"your {what} resulted in {prompt_len} tokens, which leaves no room for the completion "
            f"(at least 1 token). Please reduce the length of the {what}."
        )
    return (
        head + f"you requested {prompt_len + max_new_tokens} tokens ({prompt_len} in the {what}, "
        f"{max_new_tokens} in the completion). Please reduce the length of the {what} or completion."
    )


def chat_text_chars(chat: tokenizer_pb2.ChatInput) -> int:
    """Characters of message text in ``chat``: content, text parts, reasoning, tool-call arguments."""
    total = 0
    for msg in chat.messages:
        total += len(msg.content) + len(msg.reasoning_content)
        total += sum(len(part.text) for part in msg.content_parts)
        total += sum(len(call.function_arguments) for call in msg.tool_calls)
    return total


@dataclass(frozen=True)
class PromptBounds:
    """The bounds of one model (see the module docstring); each check raises ``BoundExceeded``.

    Attributes:
        context_length: the model's context window, in tokens.
        vocab_size: ids are in [0, vocab_size).
        chars_per_token: the most characters one token stands for; None: no character bound.
    """

    context_length: int
    vocab_size: int
    chars_per_token: int | None

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
            raise BoundExceeded(
                f"This model's maximum context length is {self.context_length} tokens. However, your {what} "
                f"{chars} characters, and more than {bound} characters cannot fit ({self.max_prompt_tokens} "
                f"tokens of at most {self.chars_per_token} characters each). Please reduce the length of the "
                f"{param}.", param)

    def _chat(self, chat: tokenizer_pb2.ChatInput) -> None:
        count = len(chat.messages)
        if count > self.max_prompt_tokens:
            raise BoundExceeded(
                f"This model's maximum context length is {self.context_length} tokens. However, you sent {count} "
                f"messages, and more than {self.max_prompt_tokens} messages cannot fit (each takes at least one "
                "token). Please reduce the number of messages.", "messages")
        self._chars(chat_text_chars(chat), "messages have", "messages")

    def check_generate(self, req: tokenizer_pb2.GenerateReqInput) -> None:
        """Text, chat or input ids of a Generate request (the tokenizer checks the rest)."""
        if req.WhichOneof("input") == "input_ids" and len(req.input_ids.ids) > self.max_prompt_tokens:
            sp = req.sampling_params  # the message the tokenizer gives after its own count
            max_new = sp.max_new_tokens if sp.HasField("max_new_tokens") else None
            raise BoundExceeded(context_overflow_message(self.context_length, len(req.input_ids.ids), max_new,
                                                         "prompt"), "prompt")
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
            raise BoundExceeded(f"ids: {len(req.ids)} ids are more than this model's maximum context length of "
                                f"{self.context_length} tokens", "ids")

    def check_token_pieces(self, req: tokenizer_pb2.TokenIds) -> None:
        if len(req.ids) > self.vocab_size:
            raise BoundExceeded(f"ids: {len(req.ids)} ids are more than the vocabulary's {self.vocab_size} "
                                "(each id once is the whole vocabulary)", "ids", INVALID_VALUE)
