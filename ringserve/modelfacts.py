"""Facts of a model directory that more than one service needs: its EOS ids and its vocabulary sizes.

**EOS ids** (``eos_token_ids``) are one set, read once per service from the same files: the
tokenizer service reports it (``ModelInfo.eos_token_ids``), the scheduler stops on it (unless
``ignore_eos``) and bans it below ``min_new_tokens``, and the grammar backends end a grammar
with it. A client that reads ModelInfo therefore knows every id that can end its output.

**Two vocabulary sizes**, which differ whenever the embedding is padded and are never
interchangeable:

- the *tokenizer vocabulary size* (``tokenizer_vocab_size``): the ids the tokenizer can turn
  into text, ``[0, n)``: its model's tokens plus its added tokens (what transformers'
  ``len(tokenizer)`` counts). The tokenizer service checks client ids against it (input_ids,
  stop_token_ids, logit_bias keys, Detokenize) and reports it as ``ModelInfo.vocab_size``; the
  detokenizer checks every id it decodes against it.
- the *model vocabulary size* (config.json's ``vocab_size``): the rows of the embedding and the
  width of the logits, often padded past the tokenizer's to a multiple of 64 or 128 (Qwen2.5:
  151,936 rows for 151,665 tokens). Only the scheduler uses it: it checks input ids against it
  (an id past it would index outside the embedding) and sizes the logits, the sampler's
  tensors and the grammar bitmask by it.

Torch-free, and reads only JSON: every service imports it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol


class _Vocabulary(Protocol):
    def get_vocab_size(self, with_added_tokens: bool = True) -> int: ...


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def eos_token_ids(model_dir: Path, token_to_id: Callable[[str], int | None]) -> tuple[int, ...]:
    """Every id that any file of ``model_dir`` names as end of sequence, in first-named order.

    The union, without repeats, of tokenizer_config.json's ``eos_token`` and the older
    special_tokens_map.json's (a string, or a dict with ``content``; looked up with
    ``token_to_id``, skipped when the vocabulary lacks it), config.json's ``eos_token_id``
    and generation_config.json's ``eos_token_id`` (each an int or a list).

    Why the union, and not one file with the others as fallbacks: a server must stop wherever
    the model says it is done. Chat models name their end-of-turn token (``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>``) in one file and keep the pre-training
    ``<|endoftext|>`` in another; generating past either produces text after the answer
    ended. An id that a file names as EOS is never ordinary text, so stopping on it costs
    nothing. (HF transformers' ``generate`` stops on generation_config's list, which itself
    is usually the union.)

    Args:
        model_dir: a model directory (any of the files may be missing).
        token_to_id: the vocabulary's token -> id lookup returning None for an unknown token
            (``tokenizers.Tokenizer.token_to_id``).

    Returns:
        The ids; empty when no file names one (the scheduler refuses such a model).
    """
    named: list[int | None] = []
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        eos = _read_json(model_dir / name).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            named.append(token_to_id(eos))
    named += _ids(_read_json(model_dir / "config.json").get("eos_token_id"))
    named += _ids(_read_json(model_dir / "generation_config.json").get("eos_token_id"))
    return tuple(dict.fromkeys(i for i in named if i is not None))


def tokenizer_vocab_size(vocabulary: _Vocabulary) -> int:
    """The tokenizer vocabulary size (module docstring): ids ``[0, n)`` the tokenizer decodes.

    Args:
        vocabulary: a ``tokenizers.Tokenizer`` (a transformers tokenizer's ``backend_tokenizer``).
    """
    return vocabulary.get_vocab_size(with_added_tokens=True)
