"""``TokenPieces``: per-id text and raw bytes in one call (the gateway's logprob token strings)."""

from __future__ import annotations

import pytest

from ringserve.v1 import tokenizer_pb2
from services.tokenizer.errors import RequestError


def test_pieces_bytes_rebuild_multibyte_text(manager, smollm2_tokenizer):
    text = "café 社区 👍🏽 hi"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False) + [2]  # 2 = <|im_end|>
    resp = manager.preparer.token_pieces(tokenizer_pb2.TokenIds(ids=ids))
    assert len(resp.texts) == len(resp.token_bytes) == len(ids)
    assert b"".join(resp.token_bytes).decode() == text + "<|im_end|>"
    assert list(resp.texts) == [smollm2_tokenizer.decode([i]) for i in ids]
    assert "\ufffd" in "".join(resp.texts)  # pieces of 社 decode to U+FFFD alone, as in vLLM
    for t, b in zip(resp.texts, resp.token_bytes, strict=True):
        if "\ufffd" not in t:
            assert b == t.encode()


def test_pieces_reject_ids_outside_the_vocabulary(manager):
    with pytest.raises(RequestError):
        manager.preparer.token_pieces(tokenizer_pb2.TokenIds(ids=[manager.facts.vocab_size]))
    assert list(manager.preparer.token_pieces(tokenizer_pb2.TokenIds()).texts) == []
