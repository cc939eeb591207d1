"""Model registry: HF ``architectures`` name -> model class.

Explicit on purpose: an architecture not listed here fails at load with its name and the
supported ones, rather than falling back to a model that computes something else.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.scheduler.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
}


def load_model(model_dir: Path, dtype: torch.dtype) -> LlamaForCausalLM:
    """Load the model that ``model_dir``/config.json names.

    Raises:
        ValueError: the config names no architecture this registry supports.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch].load(Path(model_dir), dtype)
    raise ValueError(f"unsupported architectures {archs}; supported: {sorted(ARCHITECTURES)}")
