"""Reading a LoRA adapter in PEFT's format and checking it against the served model.

A PEFT LoRA adapter is a directory holding ``adapter_config.json`` (``peft_type`` "LORA",
``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``, ...) and
``adapter_model.safetensors`` with, per adapted module, ``lora_A.weight`` [r, in] and
``lora_B.weight`` [out, r] under the base model's module names
(``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``). The scale is
``lora_alpha / r`` (Hu et al. 2021), or ``lora_alpha / sqrt(r)`` when ``use_rslora``
(Kalajdzievski 2023, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA").

Everything an adapter could get wrong is an ``AdapterError`` naming it: a missing file, a
PEFT feature this server does not apply (DoRA, per-module ranks, trained biases, saved
modules), a rank over ``--max-lora-rank``, a target module the model does not have, a tensor
of the wrong shape or for a layer the model does not have.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

# The modules an adapter may target: the attention's and the gated MLP's projections.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.default)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the adapter's path and what is wrong."""


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter as read: rank, scale and its (A, B) pairs.

    Attributes:
        rank: r.
        scale: the factor of ``x @ A^T @ B^T`` (alpha / r, or alpha / sqrt(r) with rsLoRA).
        tensors: (layer index, module name such as "q_proj") -> (A [r, in], B [out, r]),
            the whole (unsharded) tensors on the CPU in the file's dtype.
    """

    rank: int
    scale: float
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter(path: Path, shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int) -> AdapterWeights:
    """Read and check the PEFT LoRA adapter in directory ``path``.

    Args:
        shapes: the model's adaptable modules: name ("q_proj", ...) -> (in features, out
            features) of the whole (unsharded) linear.
        num_layers: the model's decoder layers.
        max_rank: ``--max-lora-rank``.

    Raises:
        AdapterError: see the module docstring.
    """
    from safetensors.torch import load_file  # the scheduler's dependency; imported where adapters load

    path = Path(path)
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    for f in (config_path, weights_path):
        if not f.is_file():
            raise AdapterError(f"adapter {path}: no {f.name} (a PEFT LoRA adapter directory holds {CONFIG_FILE} "
                               f"and {WEIGHTS_FILE})")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {path}: {CONFIG_FILE} is not readable JSON: {exc}") from exc
    rank, targets = _check_config(path, config, shapes, max_rank)
    alpha = float(config.get("lora_alpha") or rank)
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        raw = load_file(str(weights_path))
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise AdapterError(f"adapter {path}: {WEIGHTS_FILE} is not readable: {exc}") from exc
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"adapter {path}: tensor {key!r} is not a LoRA A/B weight of a decoder layer's "
                               f"{', '.join(TARGET_MODULES)}")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in targets:
            raise AdapterError(f"adapter {path}: tensor {key!r} is for module {module!r}, not among the target "
                               f"modules {sorted(targets)}")
        if layer >= num_layers:
            raise AdapterError(f"adapter {path}: tensor {key!r} is for layer {layer}; the model has {num_layers}")
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(tensor.shape) != want:
            raise AdapterError(f"adapter {path}: tensor {key!r} has shape {list(tensor.shape)}, expected "
                               f"{list(want)} (rank {rank}, {module} of {fan_in} -> {fan_out})")
        parts.setdefault((layer, module), {})[which] = tensor
    tensors = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"adapter {path}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        tensors[(layer, module)] = (ab["A"], ab["B"])
    if not tensors:
        raise AdapterError(f"adapter {path}: {WEIGHTS_FILE} holds no LoRA weights")
    return AdapterWeights(rank, scale, tensors)


def _check_config(path: Path, config: dict, shapes: dict[str, tuple[int, int]], max_rank: int) -> tuple[int, set[str]]:
    """The adapter's rank and target modules from its config; AdapterError for what is not served."""
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"adapter {path}: peft_type {config.get('peft_type')!r}; only LORA adapters are served")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"adapter {path}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"adapter {path}: rank {rank} is over --max-lora-rank {max_rank}")
    unsupported = [name for name, off in (("use_dora", False), ("fan_in_fan_out", False), ("rank_pattern", {}),
                                          ("alpha_pattern", {}), ("modules_to_save", None), ("bias", "none"))
                   if config.get(name) not in (off, None)]
    if unsupported:
        raise AdapterError(f"adapter {path}: {', '.join(f'{n}={config[n]!r}' for n in unsupported)} is not "
                           "supported (plain LoRA of the linears only)")
    declared = config.get("target_modules")
    if isinstance(declared, str):  # a regular expression (or "all-linear") over the module paths
        return rank, set(shapes) if declared == "all-linear" else {m for m in shapes if re.search(declared, m)}
    if not isinstance(declared, list) or not declared:
        raise AdapterError(f"adapter {path}: target_modules must be a list of module names, got {declared!r}")
    unknown = [m for m in declared if m not in shapes]
    if unknown:
        raise AdapterError(f"adapter {path}: unknown target module(s) {unknown}; this model's adaptable modules "
                           f"are {list(shapes)}")
    return rank, set(declared)
