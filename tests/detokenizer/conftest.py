"""Vocabularies for the detokenizer tests, prepared from registry packages (ringserve.models)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ringserve import models
from services.detokenizer.vocab import build_byte_table, load_tokenizer
from tests.helpers.repo import CACHE_DIR
from tests.helpers.tiers import model_fixture
from tests.helpers.vocabs import VOCABS


@model_fixture(scope="session")
def vocab_dirs() -> dict[str, Path]:
    """name -> directory with tokenizer.json, for SmolLM2, Qwen2.5, Gemma 3 and Gemma 3 with Strip."""
    return {name: models.PREPARERS[name](CACHE_DIR) for name in VOCABS}


@pytest.fixture(scope="session")
def tokenizers(vocab_dirs):
    return {name: load_tokenizer(path) for name, path in vocab_dirs.items()}


@pytest.fixture(scope="session")
def tables(tokenizers):
    """Verified fast-path tables (None would mean the vocabulary failed verification)."""
    return {name: build_byte_table(tok) for name, tok in tokenizers.items()}


@pytest.fixture(scope="session")
def ref_tables(tables):
    """Per vocabulary, a verified table of its ids (byte tokens, pieces) for building and
    judging streams; gemma3-strip shares Gemma 3's ids, so it uses Gemma 3's table."""
    return {**tables, "gemma3-strip": tables["gemma3"]}


@pytest.fixture(scope="session")
def make_manager(tokenizers, tables):
    """make_manager(vocab, fast=True, **kwargs): a DetokenizerManager reusing the verified table.

    A vocabulary whose table failed verification (gemma3-strip) gets the offset path at once,
    as the manager would after building and rejecting its table again (seconds for a 262k-entry
    vocabulary, at every call; test_vocabularies checks the rejection once)."""
    from services.detokenizer.manager import DetokenizerManager

    def make(vocab: str, fast: bool = True, **kwargs) -> DetokenizerManager:
        if fast and tables[vocab] is not None:
            return DetokenizerManager(tokenizers[vocab], table=tables[vocab], **kwargs)
        return DetokenizerManager(tokenizers[vocab], use_fast_path=False, **kwargs)

    return make
