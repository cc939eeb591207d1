"""Weights into a built model: a checkpoint's safetensors, or random weights of its shapes.

One loop for every architecture (nano-vllm's ``utils/loader.py``): each checkpoint tensor is
named to a parameter by the model (``DecoderForCausalLM.map_checkpoint``) and handed to that
parameter's ``weight_loader``, which copies this rank's shard of it into place
(``layers.parallel_linear``); a parameter without one takes the tensor whole. Tensors are
read one at a time: on one rank straight onto the model's device, under tensor parallelism
to the host, from where only the shard goes to the device. Every part of every parameter
must arrive (``shard_ids``): the model is built with uninitialized memory.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from services.scheduler.layers.parallel_linear import load_whole


def load_checkpoint(model: torch.nn.Module, model_dir: Path, device: torch.device) -> None:
    """Fill ``model`` from every ``*.safetensors`` file in ``model_dir``.

    Raises:
        FileNotFoundError: no safetensors file.
        RuntimeError: a checkpoint tensor no parameter takes, or parameters (or parts of fused
            ones) no tensor filled, named.
        ValueError: a tensor whose shape does not fit its parameter.
    """
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}
    unexpected: list[str] = []
    read_on = str(device) if model.tp.size == 1 else "cpu"
    for f in files:
        with safe_open(str(f), framework="pt", device=read_on) as tensors:
            for key in tensors.keys():
                mapped = model.map_checkpoint(key, tensors.get_tensor(key))
                if mapped is None:
                    continue
                name, part, tensor = mapped
                if name not in params:
                    unexpected.append(key)
                    continue
                param = params[name]
                getattr(param, "weight_loader", load_whole)(param, tensor, part)
                loaded.setdefault(name, set()).add(part)
    if unexpected:
        raise RuntimeError(f"unexpected weights in {model_dir}: {', '.join(unexpected[:8])}")
    model.finish_load(set(loaded))
    _check_complete(model, loaded)


def fill_random(model: torch.nn.Module, whole: torch.nn.Module, dtype: torch.dtype, device: torch.device,
                seed: int | None = 0) -> None:
    """Random weights: N(0, 0.02) matrices (as HF's ``initializer_range``), unit norms, zero
    biases, drawn on ``device`` for the whole model (``whole``: the same architecture at
    tensor-parallel size 1, on the meta device) in its parameter order, each handed to
    ``model``'s parameter's loader with no part: every rank keeps its shard of one model.
    Reproducible through ``seed`` (per device kind; None = torch's global generator)."""
    gen = None if seed is None else torch.Generator(device).manual_seed(seed)
    params = dict(model.named_parameters())
    for name, p in whole.named_parameters():
        if name.endswith("norm.weight"):
            value = torch.ones(p.shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            value = torch.zeros(p.shape, dtype=dtype, device=device)
        else:
            value = torch.empty(p.shape, dtype=torch.float32, device=device).normal_(generator=gen).mul_(0.02).to(dtype)
        getattr(params[name], "weight_loader", load_whole)(params[name], value, None)


def _check_complete(model: torch.nn.Module, loaded: dict[str, set]) -> None:
    """Raise RuntimeError naming every parameter (and part) no checkpoint tensor filled."""
    missing = []
    for name, p in model.named_parameters():
        got = loaded.get(name, set())
        if None in got:
            continue
        lacking = getattr(p, "shard_ids", frozenset({None})) - got
        if lacking == {None}:
            missing.append(name)
        elif lacking:
            parts = sorted(".".join(map(str, s)) if isinstance(s, tuple) else str(s) for s in lacking)
            missing.append(f"{name} (parts {', '.join(parts[:6])}{', ...' if len(parts) > 6 else ''})")
    if missing:
        raise RuntimeError(f"missing weights: {'; '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
