"""Text workloads for ``ringserve bench compare --workload``: prompts whose answer repeats
much of the prompt (what n-gram speculative decoding is for), sent as chat messages.

``copy``: a passage of Python's own documentation (``corpus.python_docs_text``) of about
``input_len`` tokens and the instruction to repeat it word for word; each prompt takes the
passage at a seeded offset. The model's answer quotes the passage: a copy-heavy workload in
the manner of code edits, summaries with quotes and JSON that echoes its input.
"""

from __future__ import annotations

import random

from ringserve.bench.corpus import python_docs_text
from ringserve.bench.dataset import BenchRequest

INSTRUCTION = "Repeat the following text exactly, word for word, and nothing else.\n\n"


def copy_requests(num_prompts: int, input_len: int, output_len: int, tokenizer, seed: int = 0) -> list[BenchRequest]:
    """``num_prompts`` copy prompts of about ``input_len`` passage tokens (``tokenizer``: a
    ``tokenizers.Tokenizer``); the same arguments give the same requests on every run."""
    ids = tokenizer.encode(python_docs_text()).ids
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        start = rng.randrange(0, len(ids) - input_len)
        text = INSTRUCTION + tokenizer.decode(ids[start : start + input_len])
        out.append(BenchRequest(tuple(tokenizer.encode(text).ids), output_len, text))
    return out
