"""Model registry: HF ``architectures`` name -> model class.

Explicit on purpose: an architecture not listed here fails at load with its name and the
supported ones, rather than falling back to a model that computes something else.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.scheduler.models.gemma3 import Gemma3ForCausalLM
from services.scheduler.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def load_model(model_dir: Path, dtype: torch.dtype, load_format: str = "auto",
               attention_backend: str = "auto", device: torch.device = torch.device("cpu")) -> LlamaForCausalLM:
    """Load the model that ``model_dir``/config.json names.

    Args:
        load_format: "auto" reads the directory's safetensors; "dummy" gives random
            weights of the config's shapes (benchmarks of sizes no package ships).
        attention_backend: "auto", "torch", "cpu" or "triton" (``layers.attention_backend``).
        device: where the weights load (``engine.device.resolve_device``).

    Raises:
        ValueError: the config names no architecture this registry supports, an
            unknown load format or an unknown attention backend.
        RuntimeError: an attention backend that cannot run where the weights are.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            if load_format == "auto":
                return ARCHITECTURES[arch].load(Path(model_dir), dtype, attention_backend, device)
            if load_format == "dummy":
                return ARCHITECTURES[arch].dummy(cfg, dtype, attention_backend=attention_backend, device=device)
            raise ValueError(f"unknown load format {load_format!r}; supported: auto, dummy")
    raise ValueError(f"unsupported architectures {archs}; supported: {sorted(ARCHITECTURES)}")
