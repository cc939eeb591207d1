"""Text workloads for ``ringserve bench compare --workload``, sent as chat messages: prompts
whose answer repeats much of the prompt (what n-gram speculative decoding is for), and
ordinary chat, where it does not.

``copy``: a passage of Python's own documentation (``corpus.python_docs_text``) of about
``input_len`` tokens and the instruction to repeat it word for word; each prompt takes the
passage at a seeded offset. The model's answer quotes the passage: a copy-heavy workload in
the manner of code edits, summaries with quotes and JSON that echoes its input.

``chat``: a short request for free-form prose on one of a few topics (the prompt holds
nothing to copy).
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


CHAT_TOPICS = ("the sea", "a robot who learns to paint", "bread baking", "winter in a small town", "a lighthouse",
               "the history of chess", "rain", "learning the violin", "mountain climbing", "a public library")


def chat_requests(num_prompts: int, output_len: int, tokenizer, seed: int = 0) -> list[BenchRequest]:
    """``num_prompts`` ordinary chat prompts (a topic each, drawn with ``seed``)."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        text = f"Write a few paragraphs about {rng.choice(CHAT_TOPICS)}, in your own words."
        out.append(BenchRequest(tuple(tokenizer.encode(text).ids), output_len, text))
    return out
