"""The random-ids dataset and Poisson arrival times.

The dataset follows SGLang bench_serving's ``random`` dataset: each prompt is a run of
token ids drawn uniformly from the vocabulary, its length drawn uniformly from
``[max(1, int(input_len * range_ratio)), input_len]`` (``range_ratio = 1`` gives fixed
lengths); output lengths likewise. (vLLM's ``--random-range-ratio`` is symmetric around
the mean instead; SGLang's form keeps ``input_len`` an upper bound.)

Prompts are sent as token-id lists to ``/v1/completions`` (the OpenAI spec allows
``prompt: list[int]``; ringserve, vLLM, SGLang and llama-server accept it), so the server
sees exactly ``input_len`` tokens with no decode/re-encode drift. For the chat endpoint,
or ``--prompt-format text``, the ids are decoded to text, by the server's
``/v1/detokenize`` or by a local ``tokenizers`` file; the server's usage chunk then gives
the true prompt length.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    """One prompt: token ids (and, when needed, their decoded text) and the output length."""

    prompt_ids: tuple[int, ...]
    output_len: int
    prompt_text: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def sample_lengths(rng: random.Random, n: int, length: int, range_ratio: float) -> list[int]:
    """``n`` lengths uniform in ``[max(1, int(length * range_ratio)), length]`` (SGLang's rule).

    Raises:
        ValueError: ``length < 1`` or ``range_ratio`` outside [0, 1].
    """
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0 <= range_ratio <= 1:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(length * range_ratio))
    return [rng.randint(low, length) for _ in range(n)]


def random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    range_ratio: float = 1.0,
    seed: int = 0,
    exclude_ids: frozenset[int] = frozenset(),
) -> list[BenchRequest]:
    """``num_prompts`` prompts of random token ids in ``[0, vocab_size)``, minus ``exclude_ids``.

    ``exclude_ids`` keeps special tokens (EOS, chat markers) out of the prompts. The same
    arguments give the same requests on every run.
    """
    rng = random.Random(seed)
    in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    allowed = [i for i in range(vocab_size) if i not in exclude_ids]
    return [
        BenchRequest(prompt_ids=tuple(rng.choices(allowed, k=n_in)), output_len=n_out)
        for n_in, n_out in zip(in_lens, out_lens, strict=True)
    ]


def arrival_offsets(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Send times (s, from the start) of a Poisson process with ``request_rate`` req/s.

    Gaps are exponential with mean ``1 / request_rate`` (vLLM's and SGLang's default,
    burstiness 1). ``request_rate = inf`` sends everything at time 0. Deterministic for a
    given ``seed``.

    Raises:
        ValueError: ``request_rate <= 0``.
    """
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


@functools.lru_cache(maxsize=4)
def local_tokenizer_info(tokenizer_dir: str):
    """``(tokenizer, vocab_size, special_ids)`` from ``tokenizer_dir/tokenizer.json``, loaded once.

    Uses the Rust ``tokenizers`` library only (no transformers import).
    """
    from pathlib import Path

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    specials = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    return tok, tok.get_vocab_size(with_added_tokens=True), specials
