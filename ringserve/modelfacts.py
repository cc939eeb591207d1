"""Facts of a model directory that more than one service needs: its EOS ids, its vocabulary sizes
and how its embeddings are pooled.

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

**Embedding pooling** (``embedding_facts``): a sentence-transformers model says how its
embeddings are made in ``modules.json`` and its Pooling module's ``config.json``; the scheduler
pools as they say (unless its flags say otherwise) and the tokenizer service checks a request's
``dimensions`` against the Matryoshka sizes config.json declares.

Torch-free, and reads only JSON: every service imports it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
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


# Pooling of an embedding: the final hidden state of the last prompt token (decoder embedding
# models such as Qwen3-Embedding), the mean over the prompt's tokens, or the first token's.
POOLING_MODES = ("last", "mean", "cls")
# sentence-transformers' Pooling config keys for the modes served; any other mode set is refused.
_ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_ST_MODULE = "sentence_transformers.models."


@dataclass(frozen=True)
class EmbeddingFacts:
    """How a model's embeddings are made, from its sentence-transformers files and config.json.

    Attributes:
        pooling: the pooling mode its ``1_Pooling/config.json`` sets (one of ``POOLING_MODES``),
            None without sentence-transformers files.
        normalize: its ``modules.json`` lists a ``Normalize`` module (L2 normalisation); None
            without sentence-transformers files.
        refusal: why its sentence-transformers pipeline cannot be served (a pooling mode other
            than last/mean/cls, or a module such as ``Dense`` after the pooling), or None.
        hidden_size: config.json's ``hidden_size``: the embedding's full dimensions.
        matryoshka: config.json declares Matryoshka dimensions (``is_matryoshka`` or
            ``matryoshka_dimensions``, vLLM's keys): a client may ask for fewer.
        matryoshka_dimensions: the sizes it lists; empty: any size up to ``hidden_size``.
    """

    pooling: str | None
    normalize: bool | None
    refusal: str | None
    hidden_size: int
    matryoshka: bool
    matryoshka_dimensions: tuple[int, ...]

    def resolve(self, pooling: str | None, normalize: bool | None) -> tuple[str, bool]:
        """The (pooling mode, normalize) the scheduler serves: a flag given wins, then the
        model's sentence-transformers config, then last-token pooling, normalised."""
        mode = pooling or self.pooling or "last"
        norm = normalize if normalize is not None else self.normalize if self.normalize is not None else True
        return mode, norm

    def dimensions_refusal(self, dimensions: int) -> str | None:
        """Why a request for ``dimensions`` (> 0) cannot be served, or None."""
        if not self.matryoshka:
            return (f"dimensions is not supported by this model: its config.json declares no Matryoshka "
                    f"dimensions (is_matryoshka / matryoshka_dimensions); it embeds in {self.hidden_size}")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            return f"dimensions must be one of {list(self.matryoshka_dimensions)}, got {dimensions}"
        if not 1 <= dimensions <= self.hidden_size:
            return f"dimensions must be in [1, {self.hidden_size}], got {dimensions}"
        return None


def embedding_facts(model_dir: Path) -> EmbeddingFacts:
    """Read ``model_dir``'s embedding facts (``EmbeddingFacts``): ``modules.json`` and the
    Pooling module's ``config.json`` as sentence-transformers lays them out, and config.json.
    The tokenizer service checks ``dimensions`` with them; the scheduler pools with them."""
    config = _read_json(model_dir / "config.json")
    hidden = int(config.get("hidden_size") or config.get("text_config", {}).get("hidden_size") or 0)
    listed = config.get("matryoshka_dimensions") or ()
    matryoshka = bool(config.get("is_matryoshka")) or bool(listed)
    listing = model_dir / "modules.json"
    modules = json.loads(listing.read_text()) if listing.is_file() else None
    pooling = normalize = refusal = None
    if isinstance(modules, list):
        kinds = [str(m.get("type", "")).removeprefix(_ST_MODULE) for m in modules]
        normalize = "Normalize" in kinds
        other = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
        if other:
            refusal = f"its sentence-transformers modules {other} (after the pooling) are not served"
        if "Pooling" in kinds:
            path = modules[kinds.index("Pooling")].get("path", "")
            pool = _read_json(model_dir / path / "config.json")
            on = sorted(k for k, v in pool.items() if k.startswith("pooling_mode_") and v is True)
            if len(on) == 1 and on[0] in _ST_POOLING:
                pooling = _ST_POOLING[on[0]]
            else:
                refusal = refusal or f"its sentence-transformers pooling {on} is not served (one of " \
                                     f"{sorted(_ST_POOLING)} is)"
    return EmbeddingFacts(pooling, normalize, refusal, hidden, matryoshka, tuple(int(d) for d in listed))
