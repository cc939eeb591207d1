"""Rotary position embedding (RoPE) with the frequency scalings of transformers' ``modeling_rope_utils``.

Follows transformers' "default", "linear", "llama3" and "longrope" rope types (Phi-3's
"su" is longrope's old name) so that the native model reproduces the reference logits;
the rotation is the half-split ("rotate_half") form used by Llama, Qwen, Mistral and Phi-3
checkpoints. Other rope types (dynamic, yarn, ...) are refused by name.

Partial rotary (``partial_rotary_factor`` < 1: only the first ``rotary_dim`` dims of each
head rotate) is expressed as a full-width rotation: ``rotary_permutation`` reorders the q
and k rows of the checkpoint so that rotate_half's pairs (j, j + D/2) are the rotated pairs
(i, i + rotary_dim/2), and the pass-through dims get angle 0 (cos 1, sin 0). Attention
scores are dot products of q and k heads, so the same permutation of both leaves them
unchanged; every attention backend (and the cpu backend's fused rotary kernel) then runs
the one full-width form.
"""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_type(scaling: dict | None) -> str:
    """The rope type a config's rope parameters name ("default" when none); Phi-3's "su" reads as "longrope".

    Raises:
        ValueError: a type not in ``ROPE_TYPES``, named.
    """
    scaling = scaling or {}
    name = scaling.get("rope_type", scaling.get("type", "default"))
    name = "longrope" if name == "su" else name
    if name not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {name!r}; supported: {', '.join(ROPE_TYPES)}")
    return name


def rotary_dim(head_dim: int, scaling: dict | None) -> int:
    """Dims of each head that rotate: ``int(head_dim * partial_rotary_factor)`` (transformers' rule)."""
    return int(head_dim * (scaling or {}).get("partial_rotary_factor", 1.0))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, long_context: bool = False) -> torch.Tensor:
    """Inverse frequencies, float32 [head_dim // 2] (``head_dim`` here is the rotary dim).

    Args:
        scaling: the config's rope parameters (``rope_type`` and its fields; see ``rope_type``).
            llama3: Meta's Llama 3.1 wavelength-banded scaling. linear: every frequency
            divided by ``factor``. longrope: per-frequency ``short_factor`` / ``long_factor``
            divisors (LongRoPE, Ding et al. 2024, as Phi-3 ships it).
        long_context: longrope only: the long factors (positions past
            ``original_max_position_embeddings``), else the short ones.

    Raises:
        ValueError: an unsupported rope type, named.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    kind = rope_type(scaling)
    if kind == "longrope":  # transformers' rounding: 1 / (factor * theta^x)
        factors = scaling["long_factor"] if long_context else scaling["short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
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


def longrope_attention_factor(scaling: dict, max_positions: int) -> float:
    """The factor longrope multiplies cos and sin by (transformers' default when the config
    gives no ``attention_factor``): sqrt(1 + ln(s) / ln(original)) with s = max_positions /
    original, 1 when s <= 1."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_positions / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rotary_permutation(head_dim: int, scaling: dict | None) -> torch.Tensor | None:
    """For partial rotary: the order of a head's dims (int64 [head_dim]) that puts rotated
    pair (i, i + R/2) at (j, j + D/2): [rot first half, pass first half, rot second half,
    pass second half]; None when every dim rotates. Apply it to the q and k rows of the
    checkpoint (and of per-head q/k norm weights)."""
    rot = rotary_dim(head_dim, scaling)
    if rot == head_dim:
        return None
    half, p = rot // 2, (head_dim - rot) // 2
    return torch.cat([torch.arange(0, half), torch.arange(rot, rot + p), torch.arange(half, rot),
                      torch.arange(rot + p, head_dim)])


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables [max_positions, head_dim] (float32), indexed by position.

    longrope: rows below ``original_max_position_embeddings`` use the short factors, rows
    from it on the long ones, and both are multiplied by the attention factor. A position's
    rotation therefore never depends on the rest of the batch or on how long its sequence
    grows, which keeps cached K rows (prefix cache) valid; it equals transformers' incremental
    decoding (``generate``) from a prompt within the original length, where each step
    switches on its own position.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        rot = rotary_dim(head_dim, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inv_freq(rot, theta, scaling))  # [P, R/2]
        scale = 1.0
        if rope_type(scaling) == "longrope":
            long = torch.outer(positions, rope_inv_freq(rot, theta, scaling, long_context=True))
            freqs = torch.where(positions.unsqueeze(1) >= scaling["original_max_position_embeddings"], long, freqs)
            scale = longrope_attention_factor(scaling, max_positions)
        pad = (head_dim - rot) // 2  # pass-through dims: angle 0, never scaled
        cos = torch.cat((freqs.cos() * scale, torch.ones(max_positions, pad)), dim=-1)  # [P, D/2]
        sin = torch.cat((freqs.sin() * scale, torch.zeros(max_positions, pad)), dim=-1)
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)  # [P, D]
        self.register_buffer("sin", torch.cat((sin, sin), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [T] -> (cos, sin), each [T, 1, D] in ``dtype``; computed once per step, used by
        every layer."""
        return (self.cos.index_select(0, positions).unsqueeze(1).to(dtype),
                self.sin.index_select(0, positions).unsqueeze(1).to(dtype))


def rotate_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused projection qkv [T, (Hq + 2 Hkv) * D] -> rotated q [T, Hq, D], rotated k [T, Hkv, D]
    and v [T, Hkv, D]; q and k are rotated together (one pass), then split as views."""
    t = qkv.shape[0]
    qk, v = qkv.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], dim=-1)
    qk = apply_rotary_packed(qk.view(t, num_heads + num_kv_heads, head_dim), cos, sin)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    return q, k, v.view(t, num_kv_heads, head_dim)


def apply_rotary_packed(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate q and k heads held side by side, qk [T, Hq + Hkv, D], by cos/sin [T, 1, D]
    -> new contiguous [T, Hq + Hkv, D]. One pass over both (rotating q and k separately
    took twice the ops, and per-op overhead dominates rotary at decode batch sizes)."""
    return qk * cos + _rotate_half(qk) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
