"""RMSNorm (Zhang & Sennrich 2019) as Llama-family checkpoints define it."""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back to the input dtype.

    Matches transformers' LlamaRMSNorm: the normalization runs in fp32 and the weight is
    applied after casting back, so bf16 models round where the reference does.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] any float dtype -> same shape and dtype."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
