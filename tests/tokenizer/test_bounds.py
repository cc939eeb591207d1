"""Input bounds before tokenization, without a ring: the real SmolLM2 tokenizer at the exact
boundary, and the derivation rules on small in-memory vocabularies."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from ringserve.prompt_bounds import BoundExceeded
from ringserve.v1 import tokenizer_pb2
from services.tokenizer.errors import RequestError
from services.tokenizer.manager import TokenizerManager
from services.tokenizer.model import model_facts

# SmolLM2's longest token: a newline and 80 spaces.
LONGEST = "\n" + " " * 80


def refused(call) -> RequestError:
    with pytest.raises(RequestError) as info:
        asyncio.run(call)
    assert info.value.status == grpc.StatusCode.INVALID_ARGUMENT
    return info.value


async def first(manager: TokenizerManager, req: tokenizer_pb2.GenerateReqInput) -> tokenizer_pb2.GenerateOutput:
    gen = manager.generate(req)
    try:
        return await gen.__anext__()
    finally:
        await gen.aclose()


def test_smollm2_bound_is_its_longest_token_times_the_prompt_tokens(smollm2_bounds):
    from services.tokenizer.bounds import InputBounds

    assert smollm2_bounds == InputBounds(context_length=8192, vocab_size=49152, chars_per_token=81)
    assert (smollm2_bounds.max_prompt_chars, smollm2_bounds.max_prompt_tokens) == (8191 * 81, 8191)


def test_one_character_over_the_bound_is_refused_before_tokenizing(manager, dispatcher):
    req = tokenizer_pb2.GenerateReqInput(rid="big", text=LONGEST * 8191 + "x")
    err = refused(first(manager, req))
    assert (err.code, err.param) == ("context_length_exceeded", "prompt")
    assert err.message == (
        "This model's maximum context length is 8192 tokens. However, your prompt has 663472 characters, and more "
        "than 663471 characters cannot fit (8191 tokens of at most 81 characters each). Please reduce the length "
        "of the prompt.")
    tokenize = tokenizer_pb2.TokenizeRequest(text=LONGEST * 8191 + "x")
    assert refused(manager.tokenize(tokenize)).message == err.message
    assert dispatcher.reqs == [] and manager.load().req_states == 0


@pytest.fixture
def small(smollm2_dir, smollm2_tokenizer, dispatcher) -> TokenizerManager:
    """SmolLM2 with ``--context-length 101``: 100 prompt tokens, bound 8,100 characters."""
    facts = model_facts(smollm2_dir, smollm2_tokenizer, context_length=101)
    return TokenizerManager(smollm2_tokenizer, facts, "tok-test", dispatcher)


def test_at_the_bound_the_prompt_is_tokenized_and_can_fit(small):
    # 100 copies of the longest token are exactly 100 tokens: the bound cannot be lower.
    assert small.bounds.max_prompt_chars == 8100
    fits = tokenizer_pb2.GenerateReqInput(rid="fits", text=LONGEST * 100)
    small.bounds.check_generate(fits)
    sent = small.prepare(fits).subs[0]
    assert (len(sent.input_ids), sent.sampling_params.max_new_tokens) == (100, 1)
    over = refused(first(small, tokenizer_pb2.GenerateReqInput(rid="over", text=LONGEST * 100 + " ")))
    assert "your prompt has 8101 characters, and more than 8100 characters cannot fit" in over.message
    # Under the bound a prompt of more tokens than fit is still tokenized, then refused by count.
    many = refused(first(small, tokenizer_pb2.GenerateReqInput(rid="many", text="a b " * 2025)))
    assert many.message.startswith("This model's maximum context length is 101 tokens. However, your prompt "
                                   "resulted in 4051 tokens")


def chat(n: int, content: str = "hi") -> tokenizer_pb2.ChatInput:
    return tokenizer_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="user", content=content)] * n)


def test_chat_message_count_and_text_bounds(small):
    over = refused(first(small, tokenizer_pb2.GenerateReqInput(chat=chat(101))))
    assert (over.code, over.param) == ("context_length_exceeded", "messages")
    assert over.message == (
        "This model's maximum context length is 101 tokens. However, you sent 101 messages, and more than 100 "
        "messages cannot fit (each takes at least one token). Please reduce the number of messages.")
    # 100 messages are rendered and tokenized: ChatML writes 5 tokens per message.
    rendered = refused(first(small, tokenizer_pb2.GenerateReqInput(chat=chat(100))))
    assert "However, your messages resulted in" in rendered.message
    text = tokenizer_pb2.ChatInput(messages=[
        tokenizer_pb2.ChatMessage(role="user", content_parts=[tokenizer_pb2.ContentPart(type="text", text="x" * 4000)]),
        tokenizer_pb2.ChatMessage(role="assistant", content="y" * 50, reasoning_content="r" * 50,
                                  tool_calls=[tokenizer_pb2.ToolCall(id="c", function_name="f",
                                                                     function_arguments="z" * 4001)]),
    ])
    err = refused(small.tokenize(tokenizer_pb2.TokenizeRequest(chat=text)))
    assert "your messages have 8101 characters, and more than 8100 characters cannot fit" in err.message


def test_id_counts_are_bounded(small):
    ids = tokenizer_pb2.GenerateReqInput(input_ids=tokenizer_pb2.TokenIds(ids=[5] * 101))
    err = refused(first(small, ids))
    assert err.message.startswith("This model's maximum context length is 101 tokens. However, your prompt "
                                  "resulted in 101 tokens")
    detok = refused(small.detokenize(tokenizer_pb2.DetokenizeRequest(ids=[5] * 102)))
    assert (detok.code, detok.message) == (
        "context_length_exceeded", "ids: 102 ids are more than this model's maximum context length of 101 tokens")
    assert asyncio.run(small.detokenize(tokenizer_pb2.DetokenizeRequest(ids=[28] * 101))).text == "," * 101
    pieces = refused(small.token_pieces(tokenizer_pb2.TokenIds(ids=[5] * 49153)))
    assert (pieces.code, pieces.param, pieces.message) == (
        "invalid_value", "ids",
        "ids: 49153 ids are more than the vocabulary's 49152 (each id once is the whole vocabulary)")


def bpe(normalizer=None, pre=None, **model) -> Tokenizer:
    tok = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2, "abab": 3, "<unk>": 4}, [("a", "b"), ("ab", "ab")], **model))
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    return tok


def test_derivation_rules():
    from services.tokenizer.bounds import NoBound, chars_per_token

    assert chars_per_token(bpe()) == 5  # "<unk>"
    assert chars_per_token(bpe(normalizers.NFC())) == 20
    assert chars_per_token(bpe(normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]))) == 90
    assert chars_per_token(bpe(normalizers.Replace("xyz", "w"))) == 15
    assert chars_per_token(bpe(pre=pre_tokenizers.ByteLevel())) == 5
    assert chars_per_token(bpe(unk_token="<unk>", fuse_unk=False)) == 5
    tok = bpe()
    tok.add_special_tokens(["<|a-long-control-token|>"])
    assert chars_per_token(tok) == 24
    for bad, why in [
        (bpe(normalizers.Strip()), "its normalizer Strip may delete text"),
        (bpe(normalizers.Replace("x", "")), "its normalizer Replace may delete text"),
        (bpe(pre=pre_tokenizers.Whitespace()), "its pre-tokenizer Whitespace drops text"),
        (bpe(pre=pre_tokenizers.Split(" ", "removed")), "its pre-tokenizer Split drops text"),
        (bpe(unk_token="<unk>", fuse_unk=True),
         "its BPE model may cover any run of unknown characters with one token"),
    ]:
        with pytest.raises(NoBound) as info:
            chars_per_token(bad)
        assert str(info.value) == why
    stripping = bpe()
    stripping.add_tokens([AddedToken("<mask>", lstrip=True)])
    with pytest.raises(NoBound, match="an added token strips the whitespace around it"):
        chars_per_token(stripping)


def test_without_a_character_bound_only_the_counts_apply(small):
    unbounded = dataclasses.replace(small.bounds, chars_per_token=None)
    assert unbounded.max_prompt_chars is None
    unbounded.check_generate(tokenizer_pb2.GenerateReqInput(text="x" * 10**6))
    with pytest.raises(BoundExceeded):
        unbounded.check_generate(tokenizer_pb2.GenerateReqInput(chat=chat(101)))
