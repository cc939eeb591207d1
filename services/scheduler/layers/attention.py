"""Attention over a token-granular paged KV cache, in torch on CPU.

Each request's keys and values live at scattered rows of per-layer pools
[num_tokens, kv_heads, head_dim]; a request slot's row of the req-to-token table lists
them in position order (SGLang's ReqToTokenPool / TokenToKVPool layout). A step writes
the new tokens' K/V at ``out_cache_loc``, gathers every request's K/V through
``kv_indices`` and attends with softmax in float32.

Decode (one query per request) uses grouped matmuls: on CPU, torch SDPA with a query
length of 1 was measured 20x slower than ``q @ k^T`` (5.8 ms against 0.29 ms at batch 16,
300 keys, 2 threads). Extend (prefill, with or without a cached prefix) uses SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class KVBuffers(Protocol):
    """What attention needs of the KV pool: per-layer K and V [num_tokens, kv_heads, head_dim]."""

    k_buffer: list[torch.Tensor]
    v_buffer: list[torch.Tensor]


@dataclass
class AttnMetadata:
    """Per-step attention layout, built once and shared by every layer.

    Attributes:
        is_decode: every request has exactly one new token.
        out_cache_loc: int64 [T], KV pool rows for the step's new tokens (packed order).
        kv_indices: int64 [B, L], KV pool rows of each request's keys 0..L-1 (padded rows
            point at any valid row and are masked).
        decode_mask: float32 [B, 1, 1, L] additive mask (0 / -inf), or None when every
            request has L keys.
        q_index: int64 [B, Lq], packed token index of each padded query (extend only).
        q_valid: int64 [T], flat index into [B * Lq] of each packed token (extend only).
        extend_mask: bool [B, 1, Lq, L], True where a query may attend a key; None for a
            single request without a prefix (plain causal attention).
    """

    is_decode: bool
    out_cache_loc: torch.Tensor
    kv_indices: torch.Tensor
    decode_mask: torch.Tensor | None = None
    q_index: torch.Tensor | None = None
    q_valid: torch.Tensor | None = None
    extend_mask: torch.Tensor | None = None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    meta: AttnMetadata,
    kv: KVBuffers,
    scale: float,
) -> torch.Tensor:
    """Write k/v into the KV cache, then attend.

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D] (model dtype), packed over the batch's requests.

    Returns:
        [T, Hq * D] in q's dtype.
    """
    k_buf, v_buf = kv.k_buffer[layer_id], kv.v_buffer[layer_id]
    k_buf.index_copy_(0, meta.out_cache_loc, k.to(k_buf.dtype))
    v_buf.index_copy_(0, meta.out_cache_loc, v.to(v_buf.dtype))
    # index_select on the flat index ran 3x faster than advanced indexing (measured, CPU).
    b, length = meta.kv_indices.shape
    flat = meta.kv_indices.view(-1)
    # [B, L, Hkv, D] -> [B, Hkv, L, D], float32 so the softmax and the sums accumulate in fp32.
    keys = k_buf.index_select(0, flat).view(b, length, *k_buf.shape[1:]).transpose(1, 2).float()
    values = v_buf.index_select(0, flat).view(b, length, *v_buf.shape[1:]).transpose(1, 2).float()
    if meta.is_decode:
        out = _decode(q.float(), keys, values, meta.decode_mask, scale)
    else:
        out = _extend(q.float(), keys, values, meta, scale)
    return out.to(q.dtype)


def _decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    b, hq, d = q.shape
    hkv = keys.shape[1]
    # Query heads h*G..h*G+G-1 share KV head h (transformers' repeat_kv order).
    qg = q.view(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [B, Hkv, G, L]
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, values).reshape(b, hq * d)  # [B, Hq*D]


def _extend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: AttnMetadata, scale: float) -> torch.Tensor:
    t, hq, d = q.shape
    qp = q[meta.q_index].transpose(1, 2)  # [B, Hq, Lq, D]
    if meta.extend_mask is None:
        out = F.scaled_dot_product_attention(qp, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=meta.extend_mask, scale=scale, enable_gqa=True)
    out = out.transpose(1, 2).reshape(-1, hq * d)  # [B*Lq, Hq*D]
    return out[meta.q_valid]
