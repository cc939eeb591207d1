"""Prompt preparation: render, tokenize and validate one request, with no state and no event loop.

``Preparer`` turns a ``GenerateReqInput`` into the scheduler's ``TokenizedGenerateReqInput``
per choice (``prepare``) and answers the unary tokenizer RPCs (``tokenize``, ``detokenize``,
``token_pieces``). It keeps nothing between calls, so the tokenizer service runs it on worker
threads (``services.tokenizer.manager``), off the event loop. The threads share one tokenizer:
every call here leaves the Rust tokenizer's settings as they are (no per-call truncation,
padding or ``split_special_tokens``; ``SpecialTokenGuard`` has its split encodings made once),
so concurrent calls cannot see each other's settings.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ringserve.limits import LimitExceeded, check_lora_fields
from ringserve.token_bytes import byte_level_bytes, byte_token_value
from ringserve.v1 import common_pb2, scheduler_pb2, tokenizer_pb2
from services.tokenizer.chat import render_chat
from services.tokenizer.constraints import gate_reasoning
from services.tokenizer.errors import INVALID_REQUEST, invalid, over_limit
from services.tokenizer.model import ModelFacts
from services.tokenizer.sampling import (
    check_prompt_logprobs,
    check_top_logprobs_num,
    resolve_sampling_params,
    seed_for_choice,
)
from services.tokenizer.special import SpecialTokenGuard


def _token_bytes(text: str, piece: str) -> bytes:
    """The raw bytes of one token: ``text`` when it decoded cleanly, else from its piece."""
    if "\ufffd" not in text:
        return text.encode()
    byte = byte_token_value(piece)
    if byte is not None:
        return bytes([byte])
    raw = byte_level_bytes(piece)
    return text.encode() if raw is None else raw


@dataclass(frozen=True)
class Prepared:
    """A validated request: its parent rid and one TokenizedGenerateReqInput per choice."""

    rid: str
    prompt: str | None  # rendered chat prompt or the text; None for input_ids
    subs: tuple[scheduler_pb2.TokenizedGenerateReqInput, ...]
    reasoning_open: bool = False  # the prompt opened a reasoning block (ChatInput.reasoning_start)

    @property
    def prompt_len(self) -> int:
        return len(self.subs[0].input_ids)


class Preparer:
    """Render, tokenize and validate requests (see the module docstring); safe to call from several threads.

    Args:
        tokenizer: a transformers tokenizer (``encode``, ``decode``, ``apply_chat_template``).
        facts: model facts (context length, vocab size, ...).
        instance_id: the tokenizer instance's id, sent with every request.
        allow_special_tokens_in_messages: parse control tokens that chat message text
            spells (``<|im_end|>``) as those tokens; by default they stay text (see
            ``services.tokenizer.special``).
    """

    def __init__(self, tokenizer: Any, facts: ModelFacts, instance_id: str,
                 allow_special_tokens_in_messages: bool = False):
        self.tokenizer = tokenizer
        self.guard = None if allow_special_tokens_in_messages else SpecialTokenGuard(tokenizer)
        self.facts = facts
        self.instance_id = instance_id
        # transformers' encode clears truncation and padding a tokenizer.json sets, and puts
        # split_special_tokens back, on the Rust tokenizer: once here, not in the first
        # requests while other threads tokenize with it.
        tokenizer.encode("a", add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_ids(self, ids: Any, param: str) -> list[int]:
        """``ids`` as a list, after checking it is non-empty and inside [0, vocab_size).

        Raises:
            RequestError: INVALID_ARGUMENT.
        """
        ids = list(ids)
        if not ids:
            raise invalid(f"{param} must not be empty", param)
        vocab = self.facts.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid(f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param)
        return ids

    def _added_special_tokens(self) -> tuple[list[int], list[int]]:
        """The ids ``encode(add_special_tokens=True)`` puts before and after a text (BOS, EOS)."""
        plain = self.encode("a", add_special_tokens=False)
        full = self.encode("a", add_special_tokens=True)
        at = next(i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain)
        return full[:at], full[at + len(plain) :]

    def render_chat_ids(self, chat: tokenizer_pb2.ChatInput) -> tuple[str, list[int]]:
        """(rendered prompt, its ids without added special tokens); control tokens that the
        messages spell stay text unless ``allow_special_tokens_in_messages``.

        Raises:
            RequestError: INVALID_ARGUMENT (see ``render_chat``).
        """
        if self.guard is None:
            prompt = render_chat(self.tokenizer, chat)
            return prompt, self.encode(prompt, add_special_tokens=False)
        masked, nonce, found = self.guard.mask(chat)
        return self.guard.encode(render_chat(self.tokenizer, masked), nonce, found)

    def prompt_ids(self, req: tokenizer_pb2.GenerateReqInput) -> tuple[list[int], str | None, str]:
        """(input ids, prompt text or None, OpenAI param name) of a GenerateReqInput.

        Text is tokenized with the tokenizer's default special tokens; a rendered chat
        prompt without (the template already holds them); input_ids are taken as they are.

        Raises:
            RequestError: INVALID_ARGUMENT (no input, empty prompt, bad ids, chat errors).
        """
        which = req.WhichOneof("input")
        if which == "text":
            ids = self.encode(req.text)
            if not ids:
                raise invalid("the prompt is empty (0 tokens)", "prompt")
            return ids, req.text, "prompt"
        if which == "input_ids":
            return self.check_ids(req.input_ids.ids, "input_ids"), None, "prompt"
        if which == "chat":
            prompt, ids = self.render_chat_ids(req.chat)
            if not ids:
                raise invalid("the rendered chat prompt is empty (0 tokens)", "messages")
            return ids, prompt, "messages"
        raise invalid("one of text, input_ids or chat is required", "prompt", INVALID_REQUEST)

    def prepare(self, req: tokenizer_pb2.GenerateReqInput) -> Prepared:
        """Tokenize and validate ``req``; expand n > 1 into sub-requests sharing the prompt.

        Makes a rid (uuid4 hex) when ``req.rid`` is empty. Sub-rids are ``f"{rid}-{i}"``
        when n > 1 (seeds ``seed + i`` when seeded), else the rid itself.

        Raises:
            RequestError: INVALID_ARGUMENT (see ``prompt_ids`` and ``resolve_sampling_params``).
        """
        try:
            check_lora_fields(req.lora_name)
        except LimitExceeded as exc:
            raise over_limit(exc) from None
        ids, prompt, param = self.prompt_ids(req)
        check_top_logprobs_num(req.top_logprobs_num)
        check_prompt_logprobs(req, len(ids))
        resolved = resolve_sampling_params(
            req.sampling_params, len(ids), self.facts.context_length, self.facts.vocab_size, param,
            score_only_ok=req.HasField("logprob_start_len"),
        )
        start = req.chat.reasoning_start if req.WhichOneof("input") == "chat" else ""
        opened = gate_reasoning(resolved.params, prompt, start, lambda t: self.encode(t, add_special_tokens=False))
        rid = req.rid or uuid.uuid4().hex
        subs = []
        for i in range(resolved.n):
            params = resolved.params
            if resolved.n > 1 and params.HasField("seed"):
                params = common_pb2.ResolvedSamplingParams()
                params.CopyFrom(resolved.params)
                params.seed = seed_for_choice(resolved.params.seed, i)
            subs.append(
                scheduler_pb2.TokenizedGenerateReqInput(
                    rid=f"{rid}-{i}" if resolved.n > 1 else rid,
                    input_ids=ids,
                    sampling_params=params,
                    return_logprob=req.return_logprob,
                    top_logprobs_num=req.top_logprobs_num,
                    tokenizer_id=self.instance_id,
                    stream=req.stream,
                    logprob_start_len=req.logprob_start_len if req.HasField("logprob_start_len") else None,
                    prompt_top_logprobs_num=req.prompt_top_logprobs_num,
                    priority=req.priority,
                    lora_name=req.lora_name,
                )
            )
        return Prepared(rid, prompt, tuple(subs), opened)

    def tokenize(self, req: tokenizer_pb2.TokenizeRequest) -> tokenizer_pb2.TokenizeResponse:
        """Text or chat -> ids, with special tokens added only if ``add_special_tokens``.

        Raises:
            RequestError: INVALID_ARGUMENT (no input, chat errors).
        """
        which = req.WhichOneof("input")
        if which == "text":
            prompt = req.text
            ids = self.encode(prompt, add_special_tokens=req.add_special_tokens)
        elif which == "chat":
            prompt, ids = self.render_chat_ids(req.chat)
            if req.add_special_tokens:
                prefix, suffix = self._added_special_tokens()
                ids = prefix + ids + suffix
        else:
            raise invalid("one of text or chat is required", "prompt", INVALID_REQUEST)
        return tokenizer_pb2.TokenizeResponse(
            input_ids=ids, prompt=prompt, count=len(ids), max_model_len=self.facts.context_length
        )

    def detokenize(self, req: tokenizer_pb2.DetokenizeRequest) -> tokenizer_pb2.DetokenizeResponse:
        """ids -> text. Raises RequestError (INVALID_ARGUMENT) for ids outside the vocabulary."""
        ids = list(req.ids)
        if ids:
            self.check_ids(ids, "ids")
        return tokenizer_pb2.DetokenizeResponse(
            text=self.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens)
        )

    def token_pieces(self, req: tokenizer_pb2.TokenIds) -> tokenizer_pb2.TokenPiecesResponse:
        """Each id decoded alone (special tokens kept) and its raw bytes, for logprobs.

        Bytes follow the vocabulary: byte-level BPE pieces map back through GPT-2's byte
        alphabet and ``<0xNN>`` byte-fallback pieces are that byte, so the bytes of a
        multi-byte character's pieces concatenate to the character even where each text
        is U+FFFD; otherwise the UTF-8 of the text.

        Raises:
            RequestError: INVALID_ARGUMENT for ids outside the vocabulary.
        """
        ids = self.check_ids(req.ids, "ids") if req.ids else []
        texts = self.tokenizer.backend_tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
        pieces = self.tokenizer.convert_ids_to_tokens(ids)
        out = [_token_bytes(text, piece) for text, piece in zip(texts, pieces, strict=True)]
        return tokenizer_pb2.TokenPiecesResponse(texts=texts, token_bytes=out)
