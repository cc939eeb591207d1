"""Gated activations of the MLP: the fused gate/up projection's output [T, 2 I] -> act(gate) * up [T, I]."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Activation = Callable[[torch.Tensor], torch.Tensor]


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 I] (gate, up) -> silu(gate) * up [T, I] (Llama, Qwen, Mistral, Phi-3, the MoE experts)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 I] (gate, up) -> gelu(gate) * up [T, I], GELU with the tanh approximation
    (Gemma's ``gelu_pytorch_tanh``)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# ``ModelConfig.hidden_act`` -> the gated activation.
ACTIVATIONS: dict[str, Activation] = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}
