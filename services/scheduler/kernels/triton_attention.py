"""Decode and extend attention over the token-granular paged KV cache as Triton kernels (GPU).

Each program walks a request's KV rows through its req-to-token row in blocks of
``BLOCK_N`` keys with an online softmax (Milakov & Gimelshein 2018, as in FlashAttention
and SGLang's ``decode_attention`` / ``extend_attention`` kernels), so K/V are read in
place and never gathered into a padded copy. Decode: one program per (request, query
head). Extend (prefill with or without a cached prefix): one program per (request, query
head, block of ``BLOCK_M`` new tokens), causal from the request's prefix on. Softmax
statistics and sums accumulate in float32 whatever the cache dtype (the extend kernel's
products run through ``tl.dot``: TF32 on GPUs for a float32 cache; float32 under the
interpreter, whose ``tl.dot`` cannot multiply 16-bit floats). Checked against the
torch reference under ``TRITON_INTERPRET=1`` on CPU tensors.

The GQA group size (both kernels) and the decode kernel's window are runtime arguments, not
constexprs: each is one scalar operation per program, so models that differ only there share
a compiled kernel. The extend kernel's window is a constexpr (``WINDOWED``: a mask in its
inner loop), as soft-capping is in both.

Sliding window (``window`` W > 0, a per-layer launch argument): the query at position p
sees keys p - W < j <= p; decode starts its walk at key ``seq_len - W`` and extend at the
first key its block of queries can see, so a windowed layer reads O(W) keys per query.
Attention soft-capping (``softcap`` > 0): scores become ``cap * tanh(s / cap)`` before the
softmax, tanh written as ``1 - 2 / (exp(2x) + 1)`` (no tanh in ``tl``'s core math).

The decode kernel follows the LightLLM / SGLang ``decode_attention`` layout without its
split-KV second stage (one program walks a request's whole sequence); the extend kernel
follows SGLang's ``extend_attention`` with prefix and new tokens read through the same
req-to-token row, and FlashAttention's (Dao et al. 2022) tiling of queries by ``BLOCK_M``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def interpreted() -> bool:
    """Whether these kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` was set when
    this module was imported): the only way they run on CPU tensors."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_decode_kernel, InterpretedFunction)


def _check_head_dim(d: int) -> None:
    if d < 16 or d & (d - 1):
        raise ValueError(f"the Triton attention kernels need head_dim a power of two >= 16 (tl.arange, tl.dot); "
                         f"got {d}")


def num_warps(head_dim: int, dtype: torch.dtype) -> int:
    """Warps per program of both kernels: 8 for rows of 1 KiB or more (head_dim 256 in float32),
    else 4 (Triton's default).

    A program holds [BLOCK, head_dim] tiles spread over its threads. Compiled for sm_80 and
    sm_90 (``services.scheduler.triton_aot``): at head_dim 256 in float32 four warps need more
    than the 255 registers a thread has (the extend kernel spilled, the decode kernel used
    250), eight use 160; in 16-bit floats four fit (under 200) and eight spill (ptxas then
    holds each thread to 128 registers).
    """
    return 8 if head_dim * dtype.itemsize >= 1024 else 4


def _rows(req_slots: torch.Tensor | None, b: int, device: torch.device) -> torch.Tensor:
    """Each request's row of ``kv_indices``: ``req_slots``, or 0..b-1 without them. The kernels
    always read a row index (the engine always passes slots), so there is one variant to compile
    per GPU, not one per form."""
    return torch.arange(b, device=device) if req_slots is None else req_slots


@triton.jit
def _softcap(s, cap):
    """cap * tanh(s / cap), with tanh(x) = 1 - 2 / (exp(2x) + 1) (exact limits at +-inf)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))


@triton.jit
def _decode_kernel(
    Q, K, V, KV_INDICES, ROWS, SEQ_LENS, OUT, scale, group, window, softcap,
    stride_qb, stride_qh, stride_kt, stride_kh, stride_ib, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // group  # query heads h*G..h*G+G-1 share KV head h (repeat_kv order)
    seq_len = tl.load(SEQ_LENS + b)
    row = tl.load(ROWS + b).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * stride_qb + h * stride_qh + d).to(tl.float32)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    # The query at seq_len - 1 sees its last `window` keys (window 0: all of them).
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    for start in range(first, seq_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < seq_len
        rows = tl.load(KV_INDICES + row * stride_ib + n, mask=valid, other=0).to(tl.int64)
        offs = rows[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
        k = tl.load(K + offs, mask=valid[:, None], other=0.0).to(tl.float32)  # [BLOCK_N, D]
        s = tl.sum(k * q[None, :], 1) * scale
        if SOFTCAP:
            s = _softcap(s, softcap)
        s = tl.where(valid, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        v = tl.load(V + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    tl.store(OUT + b * stride_ob + h * stride_oh + d, (acc / l_i).to(OUT.dtype.element_ty))


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, block_n: int = 64,
                     out: torch.Tensor | None = None, req_slots: torch.Tensor | None = None, window: int = 0,
                     softcap: float = 0.0) -> torch.Tensor:
    """One query per request against its paged keys and values.

    Args:
        q: [B, Hq, D] (any float dtype); k_buf, v_buf: [num_tokens, Hkv, D] (the layer's KV
            pool buffers, Hq a multiple of Hkv); kv_indices: int [B, L], KV pool rows of
            each request's keys in position order (columns past ``seq_lens[b]`` are
            ignored); seq_lens: int [B], keys per request (>= 1). All on one device.
        out: optional [B, Hq, D] in q's dtype to write into (rows of a larger output).
        req_slots: optional int [B]: request b's keys are row ``req_slots[b]`` of
            ``kv_indices`` (then the whole req-to-token table, read in place: no gather, and
            every shape fixed by B, so the launch can be captured in a CUDA graph).
        window: sliding window in tokens (0: none); softcap: logit soft-capping (0: none).

    Returns:
        [B, Hq * D] in q's dtype.

    Raises:
        ValueError: D not a power of two >= 16 (Triton block shapes).
    """
    b, hq, d = q.shape
    _check_head_dim(d)
    hkv = k_buf.shape[1]
    q = q.contiguous()
    kv_indices = kv_indices.contiguous()
    if out is None:
        out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    rows = _rows(req_slots, b, q.device)
    _decode_kernel[(b, hq)](
        q, k_buf, v_buf, kv_indices, rows, seq_lens.to(torch.int32).contiguous(), out, scale, hq // hkv, window,
        softcap, q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), kv_indices.stride(0), out.stride(0),
        out.stride(1), HEAD_DIM=d, BLOCK_N=block_n, SOFTCAP=softcap > 0, num_warps=num_warps(d, k_buf.dtype),
    )
    return out.view(b, hq * d)


@triton.jit
def _extend_kernel(
    Q, K, V, KV_INDICES, ROWS, Q_STARTS, PREFIX_LENS, EXTEND_LENS, OUT, scale, group, window, softcap,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ib, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // group
    row = tl.load(ROWS + b).to(tl.int64)
    q_start = tl.load(Q_STARTS + b)
    prefix = tl.load(PREFIX_LENS + b)
    ext = tl.load(EXTEND_LENS + b)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid_m = m < ext
    d = tl.arange(0, HEAD_DIM)
    q_offs = (q_start + m)[:, None] * stride_qt + h * stride_qh + d[None, :]
    q = tl.load(Q + q_offs, mask=valid_m[:, None], other=0.0)  # [BLOCK_M, D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + m  # query i sits at position prefix + i and sees keys 0..prefix + i
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    end = tl.minimum(prefix + ext, prefix + (tl.program_id(2) + 1) * BLOCK_M)
    first = 0
    if WINDOWED:
        # the block's first query sits at prefix + program_id(2) * BLOCK_M and sees keys after it - window
        first = tl.maximum(prefix + tl.program_id(2) * BLOCK_M - window + 1, 0)
    for start in range(first, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid_n = n < end
        rows = tl.load(KV_INDICES + row * stride_ib + n, mask=valid_n, other=0).to(tl.int64)
        offs = rows[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
        k = tl.load(K + offs, mask=valid_n[:, None], other=0.0)  # [BLOCK_N, D]
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            s = _softcap(s, softcap)
        visible = valid_n[None, :] & (n[None, :] <= q_pos[:, None])
        if WINDOWED:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # padded queries, and windowed queries that see no key of this block yet: keep the arithmetic finite
        m_new = tl.where(valid_m & (m_new > -float("inf")), m_new, 0.0)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(V + offs, mask=valid_n[:, None], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / tl.where(valid_m, l_i, 1.0)[:, None]
    o_offs = (q_start + m)[:, None] * stride_ot + h * stride_oh + d[None, :]
    tl.store(OUT + o_offs, out.to(OUT.dtype.element_ty), mask=valid_m[:, None])


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor,
                     prefix_lens: torch.Tensor, extend_lens: torch.Tensor, scale: float,
                     block_m: int = 32, block_n: int = 32, q_starts: torch.Tensor | None = None,
                     max_extend_len: int | None = None, out: torch.Tensor | None = None,
                     req_slots: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """New tokens of each request against its cached prefix and themselves (causal).

    Args:
        q: [T, Hq, D], packed: request b's ``extend_lens[b]`` queries follow request b-1's.
        k_buf, v_buf: [num_tokens, Hkv, D], already holding the new tokens' K/V.
        kv_indices: int [B, L], KV pool rows of positions 0..prefix_lens[b]+extend_lens[b]-1.
        prefix_lens, extend_lens: int [B] (extend_lens >= 1). All on one device.
        q_starts, max_extend_len: optional precomputed ``cumsum(extend_lens) - extend_lens``
            (int32 [B]) and ``max(extend_lens)`` (a host int: it sizes the grid), so a
            caller running many layers derives them once and never syncs per layer.
        out: optional [T, Hq, D] in q's dtype to write into (rows of a larger output).
        req_slots: optional int [B]: request b's keys are row ``req_slots[b]`` of
            ``kv_indices`` (the whole req-to-token table, read in place).
        window: sliding window in tokens (0: none); softcap: logit soft-capping (0: none).

    Returns:
        [T, Hq * D] in q's dtype.

    Raises:
        ValueError: D not a power of two >= 16 (Triton block shapes).
    """
    t, hq, d = q.shape
    _check_head_dim(d)
    hkv = k_buf.shape[1]
    q = q.contiguous()
    kv_indices = kv_indices.contiguous()
    ext = extend_lens.to(torch.int32)
    starts = (torch.cumsum(ext, 0) - ext) if q_starts is None else q_starts
    starts = starts.to(torch.int32).contiguous()
    if max_extend_len is None:
        max_extend_len = int(ext.max())
    if out is None:
        out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    grid = (ext.numel(), hq, triton.cdiv(max_extend_len, block_m))
    rows = _rows(req_slots, ext.numel(), q.device)
    _extend_kernel[grid](
        q, k_buf, v_buf, kv_indices, rows, starts, prefix_lens.to(torch.int32).contiguous(), ext.contiguous(), out,
        scale, hq // hkv, window, softcap,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), kv_indices.stride(0), out.stride(0), out.stride(1),
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
        # Triton's interpreter multiplies 16-bit floats in tl.dot as their raw bits (numpy
        # has no bfloat16; triton 3.9's create_dot converts only 8-bit floats): fp32 there.
        UPCAST=interpreted() and q.dtype != torch.float32, WINDOWED=window > 0, SOFTCAP=softcap > 0,
        num_warps=num_warps(d, k_buf.dtype),
    )
    return out.view(t, hq * d)
