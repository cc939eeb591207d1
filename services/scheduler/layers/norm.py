"""RMSNorm (Zhang & Sennrich 2019) in the two styles checkpoints define it, with the residual add.

- ``RMSNorm`` (Llama, Qwen, Mistral, Phi-3): ``weight * rms_normalized(x)``, normalized in
  float32, cast to x's dtype, then scaled, as transformers' ``LlamaRMSNorm``: bf16 models
  round where the reference does.
- ``OffsetRMSNorm`` (Gemma): ``rms_normalized(x) * (1 + w)`` in float32, cast back
  (transformers' ``Gemma3RMSNorm``). The module holds ``1 + w`` in float32 (the model's
  checkpoint mapping adds the one at load), so a norm is one multiply.

``add(x, residual)`` is the pre-norm decoder's "residual += x, then normalize" in one call;
on the CPU with the cpu attention backend both run in one C kernel (``FusedOps``), which
rounds where the torch ops do.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class FusedOps(Protocol):
    """Element-wise kernels an attention backend may offer the model (``kernels.cpu_kernels``)."""

    def add_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None = None) -> torch.Tensor: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(torch.nn.Module):
    """``x / rms(x) * weight``, computed in float32 and cast back to the input dtype.

    The normalization is torch's fused ``rms_norm`` kernel (one op instead of five: at batch
    1 the per-op overhead of 61 norms was ~6 ms of a decode step); it gives the same fp32
    result as ``x * rsqrt(mean(x^2) + eps)``.

    Args:
        hidden_size: the normalized dim; ``weight`` is [hidden_size] in ``dtype``, filled at load.
        fused: kernels that compute the norm (and the residual add) in one C call, for
            [T, hidden] contiguous inputs; None: torch ops.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None, fused: FusedOps | None = None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] any float dtype -> same shape and dtype."""
        if self.fused is not None:
            return self.fused.add_rms_norm(x, self.weight, self.eps)
        h = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * h.to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += x`` (in place), then the norm of ``residual``; both [T, hidden]."""
        if self.fused is not None:
            return self.fused.add_rms_norm(x, self.weight, self.eps, residual)
        return self(residual.add_(x))


class OffsetRMSNorm(RMSNorm):
    """``x / rms(x) * (1 + w)`` in float32, cast back to x's dtype (Gemma).

    ``weight`` holds ``1 + w`` in float32 whatever the model dtype. x: [..., dim] -> same
    shape and dtype.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None, fused: FusedOps | None = None):
        super().__init__(hidden_size, eps, torch.float32)  # no C kernel multiplies in this order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), self.weight.shape, eps=self.eps) * self.weight).to(x.dtype)


# ``ModelConfig.norm_style`` -> the norm class.
NORMS: dict[str, type[RMSNorm]] = {"rms": RMSNorm, "offset": OffsetRMSNorm}
