"""Attention over a token-granular paged KV cache, in torch on CPU: the ``torch`` attention
backend (``attention.backends``) and the reference the Triton kernels are checked against.

Each request's keys and values live at scattered rows of per-layer pools
[num_tokens, kv_heads, head_dim]; a request slot's row of the req-to-token table lists
them in position order (SGLang's ReqToTokenPool / TokenToKVPool layout). A step writes
the new tokens' K/V at ``out_cache_loc``, gathers every request's K/V through
``kv_indices`` and attends with softmax in float32; the matmuls run in the cache's dtype
(fp32 accumulation in the BLAS), so a bf16 model never copies its gathered K/V to fp32.

Decode (one query per request) uses two batched matmuls over the gathered rows as they
lie in the pool (see ``_decode``): on CPU, torch SDPA with a query length of 1 was measured
20x slower than ``q @ k^T`` (5.8 ms against 0.29 ms at batch 16, 300 keys, 2 threads),
and gathering [B, L, Hkv, D] then transposing (or letting bmm copy a strided operand) made
attention ~75 % of a batch-64 decode step. Extend (prefill, with or without a cached
prefix) uses SDPA. A mixed step (chunked prefill beside running decodes) packs the extend
tokens first and attends each part with its own kernel, so decode rows are never padded
to a chunk's length.

Sliding-window attention (Mistral, Gemma 2/3): a layer with ``window`` W > 0 lets the query
at position p attend only keys at positions p - W < j <= p (transformers'
``sliding_window_overlay``). The window is the layer's (passed per call), so one step's
layers mix windowed and global attention over the same req-to-token rows; the masks of
each window are derived once per step (``window_mask``) and shared by its layers. KV rows
that left every window are kept, not freed: a model's global layers still read them, and a
request's rows stay a contiguous prefix that the prefix cache can share as it is.

Attention soft-capping (Gemma 2): scores become ``cap * tanh(scores / cap)`` before the
mask and softmax, as transformers' eager attention does; SDPA cannot, so a capped extend
runs the matmul / softmax / matmul form.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


class KVBuffers(Protocol):
    """What attention needs of the KV pool: per-layer K and V [num_tokens, kv_heads, head_dim]."""

    k_buffer: list[torch.Tensor]
    v_buffer: list[torch.Tensor]


@dataclass
class ExtendLayout:
    """Attention layout of the extend part (prefill, with or without a cached prefix).

    The model runner fills the inputs (device tensors, and host ints that size shapes so
    no layer reads the device); ``gather_layouts`` derives the gathered form that the
    torch and cpu backends use (the Triton kernels read the req-to-token rows in place).

    Attributes:
        req_slots: int64 [B], each request's row of the req-to-token table.
        prefix_lens: int64 [B], cached tokens of each request before this step's new ones.
        extend_lens: int64 [B], new tokens of each request (packed in request order).
        q_valid: int64 [T], flat index into [B * Lq] of each packed token.
        max_extend_len: Lq, the longest extend (host).
        max_seq_len: L, the longest prefix + extend (host).
        plain_causal: one request without a prefix: plain causal attention, no mask (host).
        kv_indices: int64 [B, L], KV pool rows of each request's keys 0..L-1 (padded rows
            point at any valid row and are masked); derived.
        q_index: int64 [B, Lq], packed token index of each padded query (a padded query
            repeats its request's last token, so every row has a valid key); derived.
        mask: bool [B, 1, Lq, L], True where a query may attend a key; None when
            ``plain_causal``; derived.
        token_rows, token_slots, token_seq_lens: int64 [T] each, set only for deterministic
            inference: per packed token, its request's index b, its request's req slot and
            its position + 1. The cpu and triton backends then attend each extend token as
            a decode query with the decode kernel (``AttnMetadata.batch_invariant``).
        q_pos: int64 [B, Lq], position of each padded query; derived.
        window_masks: sliding window W -> bool [B, 1, Lq, L] mask of that window; filled
            on first use in a step (``window_mask``).
    """

    req_slots: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    q_valid: torch.Tensor
    max_extend_len: int
    max_seq_len: int
    plain_causal: bool = False
    kv_indices: torch.Tensor | None = None
    q_index: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    token_rows: torch.Tensor | None = None
    token_slots: torch.Tensor | None = None
    token_seq_lens: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class DecodeLayout:
    """Attention layout of the decode part (one query per request).

    Attributes:
        req_slots: int64 [B], each request's row of the req-to-token table.
        seq_lens: int64 [B], keys of each request, the new token's included.
        max_seq_len: L, the longest (host).
        uniform: every request has L keys: no mask (host).
        kv_indices: int64 [B, L], as in ``ExtendLayout``; derived.
        mask: float32 [B, 1, 1, L] additive mask (0 / -inf), None when ``uniform``; derived.
        window_masks: sliding window W -> float32 [B, 1, 1, L] additive mask of that window
            (keys at positions >= seq_len - W); filled on first use in a step (``window_mask``).
    """

    req_slots: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int
    uniform: bool = False
    kv_indices: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class AttnMetadata:
    """Per-step attention layout, built once and shared by every layer.

    The step's tokens are packed extend part first (``num_extend_tokens`` tokens), then one
    token per decoding request; either part may be absent (a mixed batch has both).

    Attributes:
        out_cache_loc: int64 [T], KV pool rows for the step's new tokens (packed order).
        req_to_token: int32 [max_reqs + 1, max_context], the req-to-token table on the
            attention's device (``ReqToTokenPool.device_table``).

    A step is batch-invariant (deterministic inference) when its extend layout carries the
    per-token fields (``ExtendLayout.token_seq_lens``): every token's attention is then one
    decode query's, computed alone in a fixed order, so it does not depend on the batch,
    on chunk boundaries or on which keys came from the prefix cache.
    """

    out_cache_loc: torch.Tensor
    req_to_token: torch.Tensor | None = None
    num_extend_tokens: int = 0
    extend: ExtendLayout | None = None
    decode: DecodeLayout | None = None


def gather_layouts(meta: AttnMetadata) -> None:
    """Derive ``kv_indices``, ``q_index`` and the masks of ``meta``'s layouts on their device.

    Device ops only, shapes from the layouts' host ints: no host sync. Masks are built only
    where some request is shorter than the longest (decode) or the extend part is not one
    plain causal prompt.
    """
    table = meta.req_to_token
    ext = meta.extend
    if ext is not None:
        ext.kv_indices = table.index_select(0, ext.req_slots).narrow(1, 0, ext.max_seq_len).long()  # [B, L]
    if ext is not None and ext.token_seq_lens is None:
        dev = ext.extend_lens.device
        i = torch.arange(ext.max_extend_len, device=dev).unsqueeze(0)  # [1, Lq]
        offset = torch.minimum(i, ext.extend_lens.unsqueeze(1) - 1)  # [B, Lq]
        starts = torch.cumsum(ext.extend_lens, 0) - ext.extend_lens
        ext.q_index = starts.unsqueeze(1) + offset
        ext.q_pos = ext.prefix_lens.unsqueeze(1) + offset  # [B, Lq]
        ext.window_masks = {}
        if not ext.plain_causal:
            keys = torch.arange(ext.max_seq_len, device=dev)
            ext.mask = (keys.view(1, 1, -1) <= ext.q_pos.unsqueeze(2)).unsqueeze(1)  # [B, 1, Lq, L]
    dec = meta.decode
    if dec is not None:
        dec.kv_indices = table.index_select(0, dec.req_slots).narrow(1, 0, dec.max_seq_len).long()  # [B, L]
        dec.window_masks = {}
        if not dec.uniform:
            keys = torch.arange(dec.max_seq_len, device=dec.seq_lens.device).unsqueeze(0)
            valid = keys < dec.seq_lens.unsqueeze(1)  # [B, L]
            dec.mask = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_fill_(
                valid.logical_not(), float("-inf")).view(valid.shape[0], 1, 1, -1)


def window_mask(layout: ExtendLayout | DecodeLayout, window: int) -> torch.Tensor:
    """The mask of sliding window ``window`` (> 0) for a layout that ``gather_layouts`` derived,
    built on first use and kept for the step's other layers with that window.

    Returns:
        extend: bool [B, 1, Lq, L], True where key j may be attended: q_pos - window < j <= q_pos.
        decode: float32 [B, 1, 1, L] additive (0 / -inf): seq_len - window <= j < seq_len.
    """
    mask = layout.window_masks.get(window)
    if mask is not None:
        return mask
    if isinstance(layout, ExtendLayout):
        keys = torch.arange(layout.max_seq_len, device=layout.q_pos.device).view(1, 1, -1)
        q_pos = layout.q_pos.unsqueeze(2)  # [B, Lq, 1]
        mask = torch.logical_and(keys <= q_pos, keys > q_pos - window).unsqueeze(1)
    else:
        keys = torch.arange(layout.max_seq_len, device=layout.seq_lens.device).unsqueeze(0)
        lens = layout.seq_lens.unsqueeze(1)
        valid = torch.logical_and(keys < lens, keys >= lens - window)  # [B, L]
        mask = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_fill_(
            valid.logical_not(), float("-inf")).view(valid.shape[0], 1, 1, -1)
    layout.window_masks[window] = mask
    return mask


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_id: int,
    meta: AttnMetadata,
    kv: KVBuffers,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Write k/v into the KV cache, then attend (extend part and decode part separately).

    Args:
        q: [T, Hq, D]; k, v: [T, Hkv, D] (model dtype), packed over the batch's requests.
        window: the layer's sliding window in tokens (0: none; see the module docstring).
        softcap: attention logit soft-capping (0: none).

    Returns:
        [T, Hq * D] in q's dtype.
    """
    k_buf, v_buf = store_kv(k, v, layer_id, meta.out_cache_loc, kv)
    n = meta.num_extend_tokens
    outs = []
    if meta.extend is not None:
        keys, values = gather_kv(k_buf, v_buf, meta.extend.kv_indices)
        outs.append(extend_attention(q.narrow(0, 0, n).to(k_buf.dtype), keys.transpose(1, 2), values.transpose(1, 2),
                                     meta.extend, scale, window, softcap))
    if meta.decode is not None:
        dec = meta.decode
        mask = window_mask(dec, window) if window > 0 else dec.mask
        outs.append(_decode(q.narrow(0, n, q.shape[0] - n).to(k_buf.dtype), k_buf, v_buf, dec.kv_indices,
                            mask, scale, softcap))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.to(q.dtype)


def store_kv(k: torch.Tensor, v: torch.Tensor, layer_id: int, out_cache_loc: torch.Tensor,
             kv: KVBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's new k, v [T, Hkv, D] at pool rows ``out_cache_loc`` (int64 [T]) of layer
    ``layer_id``, cast to the pool's dtype; returns that layer's (k_buffer, v_buffer)."""
    k_buf, v_buf = kv.k_buffer[layer_id], kv.v_buffer[layer_id]
    k_buf.index_copy_(0, out_cache_loc, k.to(k_buf.dtype))
    v_buf.index_copy_(0, out_cache_loc, v.to(v_buf.dtype))
    return k_buf, v_buf


def gather_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KV rows [B, L] -> keys, values [B, L, Hkv, D] in the cache's dtype (one index_select each)."""
    # index_select on the flat index ran 3x faster than advanced indexing (measured, CPU).
    b, length = kv_indices.shape
    flat = kv_indices.view(-1)
    keys = k_buf.index_select(0, flat).view(b, length, *k_buf.shape[1:])
    values = v_buf.index_select(0, flat).view(b, length, *v_buf.shape[1:])
    return keys, values


def _decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor,
            mask: torch.Tensor | None, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """One query per request over its gathered keys.

    Args:
        q: [B, Hq, D] in the cache's dtype; k_buf, v_buf: [N, Hkv, D]; kv_indices: int64
            [B, L]; mask: float32 [B, 1, 1, L] additive, or None; softcap: logit
            soft-capping (0: none).

    Returns:
        [B, Hq * D] in the cache's dtype.

    The K/V rows are gathered once each, as they lie in the pool (contiguous
    ``Hkv * D`` rows), and never transposed: one batched matmul multiplies every query head
    by every KV head (``Hkv`` times the few FLOPs needed) and the matching head pairs are
    read off as a diagonal; the value matmul likewise. Converting and transposing the
    gathered K/V (to fp32, or per head inside a strided bmm) was ~75 % of a batch-64
    decode step; this form was measured 1.3x faster than a per-head gather into
    contiguous blocks (1.7 against 2.2 ms a layer at batch 64, 140 keys, one core), whose
    strided row copies cost more than the extra multiplies. The matmuls run in the cache
    dtype with the BLAS's fp32 accumulation; softmax runs in fp32 and the probabilities
    are cast back before the value matmul, as transformers' eager attention does in bf16
    (in fp32 nothing rounds).
    """
    b, hq, d = q.shape
    hkv = k_buf.shape[1]
    g = hq // hkv
    length = kv_indices.shape[1]
    flat = kv_indices.view(-1)
    keys = k_buf.index_select(0, flat).view(b, length * hkv, d)  # rows (key, kv head)
    scores = torch.bmm(q.reshape(b, hq, d), keys.transpose(1, 2))  # [B, Hq, L*Hkv]
    # Query heads h*G..h*G+G-1 share KV head h (transformers' repeat_kv order).
    scores = scores.view(b, hkv, g, length, hkv).diagonal(dim1=1, dim2=4)  # [B, G, L, Hkv]
    scores = scores.permute(0, 3, 1, 2).float().mul_(scale)  # [B, Hkv, G, L], contiguous
    if softcap > 0:
        scores = softcap_scores(scores, softcap)
    if mask is not None:
        scores += mask  # [B, 1, 1, L]
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(b, hq, length)
    values = v_buf.index_select(0, flat).view(b, length, hkv * d)
    out = torch.bmm(probs, values).view(b, hkv, g, hkv, d).diagonal(dim1=1, dim2=3)  # [B, G, D, Hkv]
    return out.permute(0, 3, 1, 2).reshape(b, hq * d)


def softcap_scores(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Attention logit soft-capping (Gemma 2): ``softcap * tanh(scores / softcap)``, same shape and dtype."""
    return torch.tanh(scores / softcap) * softcap


def extend_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: ExtendLayout,
                     scale: float, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """SDPA of the packed extend tokens q [T, Hq, D] over gathered keys, values [B, Hkv, L, D]
    (cache dtype) -> [T, Hq * D]; ``window`` and ``softcap`` as in ``paged_attention``."""
    t, hq, d = q.shape
    b, lq = meta.q_index.shape
    qp = q.index_select(0, meta.q_index.view(-1)).view(b, lq, hq, d).transpose(1, 2)  # [B, Hq, Lq, D]
    mask = window_mask(meta, window) if window > 0 else meta.mask
    if softcap > 0:
        out = _capped_attention(qp, keys, values, mask, scale, softcap)
    elif mask is None:
        out = F.scaled_dot_product_attention(qp, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    out = out.transpose(1, 2).reshape(-1, hq * d)  # [B*Lq, Hq*D]
    return out.index_select(0, meta.q_valid)


def _capped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, softcap: float) -> torch.Tensor:
    """Eager attention with soft-capped scores: q [B, Hq, Lq, D], keys/values [B, Hkv, L, D],
    mask bool [B, 1, Lq, L] or None (causal, Lq == L) -> [B, Hq, Lq, D]; softmax in fp32."""
    g = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(g, dim=1), values.repeat_interleave(g, dim=1)
    scores = softcap_scores(torch.matmul(q, keys.transpose(2, 3)).float() * scale, softcap)
    if mask is None:
        lq, length = scores.shape[-2:]
        mask = torch.ones(lq, length, dtype=torch.bool, device=scores.device).tril()
    scores = scores.masked_fill(mask.logical_not(), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), values)
