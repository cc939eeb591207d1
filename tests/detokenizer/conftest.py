"""Vocabularies for the detokenizer tests, prepared from registry packages (ringserve.models)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ringserve import models
from services.detokenizer.vocab import build_byte_table, load_tokenizer

CACHE_DIR = Path(os.environ.get("RINGSERVE_CACHE_DIR", models.DEFAULT_CACHE))
VOCABS = ("smollm2", "qwen25", "gemma3")


@pytest.fixture(scope="session")
def vocab_dirs() -> dict[str, Path]:
    """name -> directory with tokenizer.json, for SmolLM2, Qwen2.5 and Gemma 3."""
    return {name: models.PREPARERS[name](CACHE_DIR) for name in VOCABS}


@pytest.fixture(scope="session")
def tokenizers(vocab_dirs):
    return {name: load_tokenizer(path) for name, path in vocab_dirs.items()}


@pytest.fixture(scope="session")
def tables(tokenizers):
    """Verified fast-path tables (None would mean the vocabulary failed verification)."""
    return {name: build_byte_table(tok) for name, tok in tokenizers.items()}


@pytest.fixture(scope="session")
def make_manager(tokenizers, tables):
    """make_manager(vocab, fast=True, **kwargs): a DetokenizerManager reusing the verified table."""
    from services.detokenizer.manager import DetokenizerManager

    def make(vocab: str, fast: bool = True, **kwargs) -> DetokenizerManager:
        if fast:
            return DetokenizerManager(tokenizers[vocab], table=tables[vocab], **kwargs)
        return DetokenizerManager(tokenizers[vocab], use_fast_path=False, **kwargs)

    return make
