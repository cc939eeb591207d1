"""Model registry: HF ``architectures`` name -> model class.

Explicit on purpose: an architecture not listed here fails at load with its name and the
supported ones, rather than falling back to a model that computes something else.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from services.scheduler.layers.parallel import TensorParallel, check_divisible
from services.scheduler.models.gemma3 import Gemma3ForCausalLM
from services.scheduler.models.llama import LlamaConfig, LlamaForCausalLM
from services.scheduler.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from services.scheduler.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}
# Architectures whose model shards itself over a tensor-parallel group (``layers.parallel``);
# the others run with --tp-size 1 only.
TENSOR_PARALLEL = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"})


def load_model(model_dir: Path, dtype: torch.dtype, load_format: str = "auto",
               attention_backend: str = "auto", device: torch.device = torch.device("cpu"),
               tp: TensorParallel = TensorParallel()) -> LlamaForCausalLM:
    """Load the model that ``model_dir``/config.json names.

    Args:
        load_format: "auto" reads the directory's safetensors; "dummy" gives random
            weights of the config's shapes (benchmarks of sizes no package ships).
        attention_backend: "auto", "torch", "cpu" or "triton" (``layers.attention_backend``).
        device: where the weights load (``engine.device.resolve_device``).
        tp: this rank's tensor-parallel group; the model keeps its shard.

    Raises:
        ValueError: the config names no architecture this registry supports, an
            unknown load format or an unknown attention backend, ``tp.size > 1`` for an
            architecture outside ``TENSOR_PARALLEL``, or sizes ``tp.size`` does not divide.
        RuntimeError: an attention backend that cannot run where the weights are.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            if tp.size > 1:
                check_tensor_parallel(model_dir, tp.size)
            if load_format == "auto":
                return ARCHITECTURES[arch].load(Path(model_dir), dtype, attention_backend, device, tp=tp)
            if load_format == "dummy":
                return ARCHITECTURES[arch].dummy(cfg, dtype, attention_backend=attention_backend, device=device, tp=tp)
            raise ValueError(f"unknown load format {load_format!r}; supported: auto, dummy")
    raise ValueError(f"unsupported architectures {archs}; supported: {sorted(ARCHITECTURES)}")


def check_tensor_parallel(model_dir: Path, size: int) -> None:
    """Refuse, before any rank starts, a model that cannot be sharded over ``size`` ranks.

    Raises:
        ValueError: an architecture outside ``TENSOR_PARALLEL`` (named), or heads, KV heads or
            intermediate size that ``size`` does not divide (``layers.parallel.check_divisible``).
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if not any(arch in TENSOR_PARALLEL for arch in archs):
        raise ValueError(f"--tp-size {size}: tensor parallelism is not implemented for {archs} yet; "
                         f"supported: {sorted(TENSOR_PARALLEL)}")
    check_divisible(LlamaConfig.from_hf(cfg), size)
