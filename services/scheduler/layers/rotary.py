"""Rotary position embedding (RoPE), with the llama3 frequency scaling.

Follows transformers' ``modeling_rope_utils`` ("default" and "llama3" rope types) so that
the native model reproduces the reference logits; the rotation is the half-split
("rotate_half") form used by Llama, Qwen2 and Mistral checkpoints.
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, float32 [head_dim // 2].

    Args:
        scaling: the config's rope parameters; ``rope_type`` "default" (or None) and
            "llama3" are supported (llama3: Meta's Llama 3.1 wavelength-banded scaling).

    Raises:
        ValueError: any other rope type (linear, dynamic, yarn, ...), named.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3")
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by the factor, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables [max_positions, head_dim] (float32), indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] -> (cos, sin), each [T, 1, D] in ``dtype``; computed once per step, used by every layer."""
        return (self.cos.index_select(0, positions).unsqueeze(1).to(dtype),
                self.sin.index_select(0, positions).unsqueeze(1).to(dtype))


def apply_rotary_packed(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate q and k heads held side by side, qk [T, Hq + Hkv, D], by cos/sin [T, 1, D]
    -> new contiguous [T, Hq + Hkv, D]. One pass over both (rotating q and k separately
    took twice the ops, and per-op overhead dominates rotary at decode batch sizes)."""
    return qk * cos + _rotate_half(qk) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
