"""The text workloads of ``ringserve bench compare --workload``."""

from __future__ import annotations

from ringserve.bench.dataset import local_tokenizer_info
from ringserve.bench.workloads import CHAT_TOPICS, INSTRUCTION, chat_requests, copy_requests


def test_copy_and_chat_prompts_are_seeded_and_sized(smollm2_dir):
    tokenizer = local_tokenizer_info(str(smollm2_dir))[0]
    copies = copy_requests(3, 64, 80, tokenizer, seed=1)
    assert copies == copy_requests(3, 64, 80, tokenizer, seed=1) != copy_requests(3, 64, 80, tokenizer, seed=2)
    for req in copies:
        assert req.prompt_text.startswith(INSTRUCTION) and req.output_len == 80
        assert list(req.prompt_ids) == tokenizer.encode(req.prompt_text).ids
        passage = len(tokenizer.encode(req.prompt_text[len(INSTRUCTION):]).ids)
        assert 56 <= passage <= 72  # the 64 tokens cut from the corpus, retokenized
    chats = chat_requests(4, 32, tokenizer, seed=0)
    assert chats == chat_requests(4, 32, tokenizer, seed=0)
    assert all(any(t in r.prompt_text for t in CHAT_TOPICS) and r.output_len == 32 for r in chats)
