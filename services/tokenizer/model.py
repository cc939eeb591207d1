"""Load the tokenizer and the model facts the tokenizer service needs from a model directory.

Reads ``tokenizer.json`` / ``tokenizer_config.json`` / ``chat_template.jinja``
through transformers, and ``config.json`` for the context length; the EOS ids and the
vocabulary size follow the shared definitions of ``ringserve.modelfacts``. It never imports
torch: ``AutoTokenizer`` pulls in ``transformers.configuration_utils`` and, through it,
torch whenever torch is installed, so the class is resolved here the way AutoTokenizer
resolves it for a local directory (``tokenizer_class`` in tokenizer_config.json, a top-level
transformers name; ``TokenizersBackend`` when absent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers

from ringserve.modelfacts import eos_token_ids, tokenizer_vocab_size


@dataclass(frozen=True)
class ModelFacts:
    """What the tokenizer service reports and validates against."""

    model_path: str
    served_model_name: str
    context_length: int  # tokens: prompt + completion must fit
    vocab_size: int  # the tokenizer vocabulary size: valid ids are [0, vocab_size)
    eos_token_ids: tuple[int, ...]  # ringserve.modelfacts.eos_token_ids: what the scheduler stops on
    has_chat_template: bool
    tool_call_parser: str = ""  # services/tokenizer/chat_template.py: the parser of the template it chose


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_tokenizer(model_dir: Path) -> Any:
    """The transformers tokenizer of ``model_dir`` (with its chat template, if any).

    Raises:
        FileNotFoundError: no tokenizer.json in ``model_dir``.
        ValueError: tokenizer_config.json names a class transformers does not have.
    """
    if not (model_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json (a fast tokenizer file is required)")
    name = _read_json(model_dir / "tokenizer_config.json").get("tokenizer_class") or "TokenizersBackend"
    cls = getattr(transformers, name, None) or getattr(transformers, name.removesuffix("Fast"), None)
    if cls is None:
        raise ValueError(f"tokenizer_config.json of {model_dir} names tokenizer_class {name!r}, "
                         "unknown to transformers")
    return cls.from_pretrained(str(model_dir))


def model_facts(
    model_dir: Path, tokenizer: Any, served_model_name: str | None = None, context_length: int | None = None,
    tool_call_parser: str = "",
) -> ModelFacts:
    """Facts of ``model_dir``: context length from the flag or config.json's max_position_embeddings.

    EOS ids and the vocabulary size are ``ringserve.modelfacts``'s: the EOS ids every file
    names (the set the scheduler stops on) and the tokenizer vocabulary size.

    Raises:
        ValueError: no context length given and none in config.json, or it is < 2.
    """
    config = _read_json(model_dir / "config.json")
    if context_length is None:
        context_length = config.get("max_position_embeddings")
        if context_length is None:
            raise ValueError(f"{model_dir}/config.json has no max_position_embeddings; pass --context-length")
    if context_length < 2:
        raise ValueError(f"context length must be at least 2 tokens, got {context_length}")
    vocabulary = tokenizer.backend_tokenizer
    return ModelFacts(
        model_path=str(model_dir),
        served_model_name=served_model_name or model_dir.resolve().name,
        context_length=int(context_length),
        vocab_size=tokenizer_vocab_size(vocabulary),
        eos_token_ids=eos_token_ids(model_dir, vocabulary.token_to_id),
        has_chat_template=bool(tokenizer.chat_template),
        tool_call_parser=tool_call_parser,
    )
