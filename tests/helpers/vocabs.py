"""The vocabularies the detokenizer tests run on (prepared by ringserve.models)."""

from __future__ import annotations

# gemma3-strip: Gemma 3's tokens behind a Llama-2-style decoder with a Strip step, which
# has no verified fast path: the general offset algorithm serves it.
VOCABS = ("smollm2", "qwen25", "gemma3", "gemma3-strip")
FAST_VOCABS = ("smollm2", "qwen25", "gemma3")
