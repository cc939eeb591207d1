"""Model registry: HF ``architectures`` name -> model class, and the one way to build a model.

Explicit on purpose: an architecture not listed here fails at load with its name and the
supported ones, rather than falling back to a model that computes something else. Every
class satisfies ``models.base.CausalLM``, the contract the engine types against.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ringserve.options.names import LOAD_FORMATS
from services.scheduler.attention.backends import create_attention_backend
from services.scheduler.executor.device import DeviceRuntime, create_runtime
from services.scheduler.layers.parallel import TensorParallel
from services.scheduler.models.base import CausalLM, LayerEnv
from services.scheduler.models.config import ModelConfig
from services.scheduler.models.decoder import DecoderForCausalLM
from services.scheduler.models.gemma3 import Gemma3ForCausalLM
from services.scheduler.models.llama import LlamaForCausalLM
from services.scheduler.models.loader import fill_random, load_checkpoint
from services.scheduler.models.moe import MoeForCausalLM

ARCHITECTURES: dict[str, type[DecoderForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Qwen3MoeForCausalLM": MoeForCausalLM,
    "Qwen2MoeForCausalLM": MoeForCausalLM,
    "MixtralForCausalLM": MoeForCausalLM,
}


def model_config(hf: dict) -> ModelConfig:
    """``ModelConfig.from_hf`` of an HF config dict whose architecture this registry serves.

    Raises:
        ValueError: no supported architecture (named, with the supported ones), or a config
            ``ModelConfig.from_hf`` refuses.
    """
    archs = hf.get("architectures") or []
    if archs and not any(a in ARCHITECTURES for a in archs):
        raise ValueError(f"unsupported architectures {archs}; supported: {sorted(ARCHITECTURES)}")
    return ModelConfig.from_hf(hf)


def build_model(hf: dict, dtype: torch.dtype, attention_backend: str = "auto", runtime: DeviceRuntime | None = None,
                tp: TensorParallel | None = None) -> CausalLM:
    """The model of an HF config dict on the runtime's device (default: the CPU) with this
    rank's shapes, its weights uninitialized (``models.loader`` fills them). The blocks get
    what the runtime and the attention backend offer (``LayerEnv``): the backend's fused
    kernels, the runtime's expert kernel.

    Raises:
        ValueError: see ``model_config`` and ``check_tensor_parallel``; an unknown attention backend.
        RuntimeError: an attention backend that cannot run on the device.
    """
    runtime = runtime or create_runtime(torch.device("cpu"))
    tp = tp or TensorParallel()
    cfg = model_config(hf)
    if tp.size > 1:
        cfg.check_tensor_parallel(tp.size)
    backend = create_attention_backend(attention_backend, runtime)
    env = LayerEnv(tp, backend, dtype, runtime.device, backend.fused_ops, runtime.fused_experts())
    with torch.device(runtime.device):
        return ARCHITECTURES[cfg.architecture](cfg, env).eval()


def load_model(model_dir: Path, dtype: torch.dtype, load_format: str = "auto",
               attention_backend: str = "auto", runtime: DeviceRuntime | None = None,
               tp: TensorParallel | None = None) -> CausalLM:
    """Load the model that ``model_dir``/config.json names.

    Args:
        load_format: "auto" reads the directory's safetensors; "dummy" gives random
            weights of the config's shapes (benchmarks of sizes no package ships).
        attention_backend: "auto", "torch", "cpu" or "triton" (``attention.backends``).
        runtime: the device the weights load onto (``executor.device.create_runtime``; default the CPU).
        tp: this rank's tensor-parallel group (default: none); the model keeps its shard.

    Raises:
        ValueError: the config names no architecture this registry supports, an
            unknown load format or an unknown attention backend, or sizes ``tp.size`` does not
            divide (``ModelConfig.check_tensor_parallel``).
        RuntimeError: an attention backend that cannot run where the weights are; missing
            or unexpected weights (``models.loader``).
        FileNotFoundError: no config.json, or no safetensors file.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; supported: {', '.join(LOAD_FORMATS)}")
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    if load_format == "dummy":
        return dummy_model(hf, dtype, attention_backend=attention_backend, runtime=runtime, tp=tp)
    model = build_model(hf, dtype, attention_backend, runtime, tp)
    load_checkpoint(model, Path(model_dir), model.attn_backend.device)
    return model


def dummy_model(hf: dict, dtype: torch.dtype, seed: int | None = 0, attention_backend: str = "auto",
                runtime: DeviceRuntime | None = None, tp: TensorParallel | None = None) -> CausalLM:
    """The model of an HF config dict with random weights (``models.loader.fill_random``): under
    tensor parallelism every rank draws the whole model and keeps its shard, so the ranks
    together hold the weights of ``tp.size`` 1. Errors as ``build_model``."""
    model = build_model(hf, dtype, attention_backend, runtime, tp)
    with torch.device("meta"):
        whole = type(model)(model.config, LayerEnv(TensorParallel(), model.attn_backend, dtype, torch.device("meta")))
    fill_random(model, whole, dtype, model.attn_backend.device, seed)
    return model


def check_tensor_parallel(model_dir: Path, size: int) -> None:
    """Refuse, before any rank starts, a model that cannot be sharded over ``size`` ranks.

    Every architecture here shards (``layers.parallel_linear``; experts along their
    intermediate dim), so only the sizes can refuse.

    Raises:
        ValueError: an unsupported architecture, or heads, KV heads or intermediate sizes that
            ``size`` does not divide (``ModelConfig.check_tensor_parallel``).
    """
    model_config(json.loads((Path(model_dir) / "config.json").read_text())).check_tensor_parallel(size)
