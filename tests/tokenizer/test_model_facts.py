"""The facts every service reads from a model directory (``ringserve.modelfacts``,
``ringserve.token_bytes``): the tokenizer reports exactly the EOS ids the scheduler stops on,
and both byte spellings decode as the real vocabularies decode them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from ringserve.modelfacts import eos_token_ids, tokenizer_vocab_size
from ringserve.token_bytes import BYTE_TO_CHAR, BYTE_TOKENS, CHAR_TO_BYTE, byte_level_bytes, byte_token_value
from services.scheduler.policy.stops import load_eos_ids
from services.tokenizer.model import load_tokenizer, model_facts


def _model_dir(tmp_path: Path, smollm2_dir: Path, files: dict[str, dict]) -> Path:
    """SmolLM2's tokenizer with the given JSON files (file name -> content) beside it."""
    shutil.copy(smollm2_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    files = {"config.json": {"max_position_embeddings": 64}, **files}
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    return tmp_path


def test_the_tokenizer_reports_every_id_the_scheduler_stops_on(tmp_path, smollm2_dir):
    """config.json names an id that neither tokenizer_config nor generation_config names: the
    scheduler used to skip it (config.json was only a fallback) while ModelInfo listed it."""
    d = _model_dir(tmp_path, smollm2_dir, {
        "tokenizer_config.json": {"eos_token": "<|im_end|>"},
        "config.json": {"max_position_embeddings": 64, "eos_token_id": 0},
        "generation_config.json": {"eos_token_id": [2, 1]},
    })
    tokenizer = load_tokenizer(d)
    reported = model_facts(d, tokenizer).eos_token_ids
    assert reported == (2, 0, 1)  # <|im_end|> is id 2; first-named order, no repeats
    assert load_eos_ids(d, Tokenizer.from_file(str(d / "tokenizer.json"))) == frozenset(reported)


def test_eos_names_in_any_file(tmp_path, smollm2_dir):
    d = _model_dir(tmp_path, smollm2_dir, {"special_tokens_map.json": {"eos_token": "<|endoftext|>"},
                                           "tokenizer_config.json": {"eos_token": "<no such token>"}})
    vocab = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert eos_token_ids(d, vocab.token_to_id) == (0,)  # an unknown token names nothing
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(d, vocab.token_to_id) == (0, 7)


def test_a_model_without_eos(tmp_path, smollm2_dir):
    d = _model_dir(tmp_path, smollm2_dir, {})
    vocab = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert eos_token_ids(d, vocab.token_to_id) == ()
    assert model_facts(d, load_tokenizer(d)).eos_token_ids == ()
    with pytest.raises(ValueError, match="no EOS token id in"):
        load_eos_ids(d, vocab)


def test_the_real_model_directory(smollm2_dir, smollm2_tokenizer):
    facts = model_facts(smollm2_dir, smollm2_tokenizer)
    assert facts.eos_token_ids == (2,)
    assert facts.vocab_size == tokenizer_vocab_size(smollm2_tokenizer.backend_tokenizer) == 49152
    assert facts.vocab_size == len(smollm2_tokenizer)  # what transformers counts


def test_gpt2_byte_map_against_a_byte_level_vocabulary(smollm2_dir):
    """The map is a bijection of the 256 bytes, and every piece of SmolLM2 whose mapped bytes are
    valid UTF-8 decodes (by the vocabulary's own ByteLevel decoder) to exactly that text."""
    vocab = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    assert sorted(BYTE_TO_CHAR) == list(range(256)) and len(CHAR_TO_BYTE) == 256
    assert (BYTE_TO_CHAR[0x20], BYTE_TO_CHAR[0x0A], BYTE_TO_CHAR[ord("a")], BYTE_TO_CHAR[0xAD]) == ("Ġ", "Ċ", "a", "Ń")
    size = tokenizer_vocab_size(vocab)
    decoded = vocab.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
    checked = 0
    for token_id, text in enumerate(decoded):
        raw = byte_level_bytes(vocab.id_to_token(token_id))
        assert raw is not None, token_id  # every SmolLM2 piece is spelled in the map
        try:
            expected = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue  # part of a character: the decoder shows U+FFFD
        assert text == expected, token_id
        checked += 1
    assert checked > 48_000
    assert byte_level_bytes("Ġhello") == b" hello"
    assert byte_level_bytes("") == b""
    assert byte_level_bytes("é") == bytes([0xE9])  # printable Latin-1 stands for its own byte
    assert byte_level_bytes("日本") is None  # characters outside the map
    assert byte_level_bytes("\u0100") == bytes([0])


def test_byte_fallback_tokens():
    assert [byte_token_value(t) for t in ("<0x0A>", "<0xff>", "<0xFF>", "<0x00>")] == [10, 255, 255, 0]
    for bad in ("<0xZZ>", "<0x0A", "<0x0A>x", "x<0x0A>", "<0x0>", "<0X0A>", "0x0A", ""):
        assert byte_token_value(bad) is None, bad
    assert len(BYTE_TOKENS) == 256 and {byte_token_value(t) for t in BYTE_TOKENS} == set(range(256))
