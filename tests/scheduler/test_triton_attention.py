"""The Triton decode and extend attention kernels against torch references, on CPU tensors under
Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is imported, hence
the subprocess)."""

from __future__ import annotations

from tests.helpers.triton_interpreter import run_interpreted

CHECK = r"""
import json, torch
from services.scheduler.attention.paged import _decode
from services.scheduler.kernels.triton_attention import decode_attention, extend_attention

torch.manual_seed(0)
errors = {}
for dtype in (torch.float32, torch.bfloat16):
    b, hq, hkv, d, pool, width = 3, 4, 2, 16, 64, 11
    k_buf, v_buf = torch.randn(pool, hkv, d).to(dtype), torch.randn(pool, hkv, d).to(dtype)
    seq_lens = torch.tensor([5, width, 1])  # one request spans three blocks, one has a single key
    kv_indices = torch.stack([torch.randperm(pool)[:width] for _ in range(b)])  # scattered rows
    q = torch.randn(b, hq, d).to(dtype)
    got = decode_attention(q, k_buf, v_buf, kv_indices, seq_lens, 0.25, block_n=4)
    valid = torch.arange(width)[None, :] < seq_lens[:, None]
    mask = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))[:, None, None, :]
    want = _decode(q.float(), k_buf.float(), v_buf.float(), kv_indices, mask, 0.25)
    errors[str(dtype)] = [list(got.shape), str(got.dtype), (got.float() - want).abs().max().item()]
    # The same rows read in place through a table and req slots (the engine's form).
    table = torch.zeros(5, width, dtype=torch.int32)
    slots = torch.tensor([4, 0, 2])
    table[slots] = kv_indices.int()
    by_slot = decode_attention(q, k_buf, v_buf, table, seq_lens, 0.25, block_n=4, req_slots=slots)
    errors["slots " + str(dtype)] = bool(torch.equal(by_slot, got))

# Extend: a fresh prompt, a single new token after a prefix, and 20 tokens after a prefix of 3.
prefix, ext = torch.tensor([0, 7, 3]), torch.tensor([9, 1, 20])
width = int((prefix + ext).max())
for dtype in (torch.float32, torch.bfloat16):
    k_buf, v_buf = torch.randn(128, 2, 16).to(dtype), torch.randn(128, 2, 16).to(dtype)
    kv_indices = torch.stack([torch.randperm(128)[:width] for _ in range(3)])
    q = torch.randn(int(ext.sum()), 4, 16).to(dtype)
    got = extend_attention(q, k_buf, v_buf, kv_indices, prefix, ext, 0.25, block_m=8, block_n=4)
    table = torch.zeros(6, width, dtype=torch.int32)
    slots = torch.tensor([5, 1, 3])
    table[slots] = kv_indices.int()
    by_slot = extend_attention(q, k_buf, v_buf, table, prefix, ext, 0.25, block_m=8, block_n=4, req_slots=slots,
                               max_extend_len=20)
    errors["extend slots " + str(dtype)] = bool(torch.equal(by_slot, got))
    want, start = [], 0
    for b in range(3):
        n, p = int(ext[b]), int(prefix[b])
        rows = kv_indices[b, : p + n]
        # GQA groups of 2
        k, v = k_buf[rows].float().repeat_interleave(2, 1), v_buf[rows].float().repeat_interleave(2, 1)
        scores = torch.einsum("thd,khd->htk", q[start : start + n].float(), k) * 0.25
        causal = torch.arange(p + n)[None, :] <= (p + torch.arange(n))[:, None]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        want.append(torch.einsum("htk,khd->thd", probs, v).reshape(n, -1))
        start += n
    err = (got.float() - torch.cat(want)).abs().max().item()
    errors["extend " + str(dtype)] = [list(got.shape), str(got.dtype), err]

# Deterministic inference: the backend attends each extend token as a decode query, so a
# token gets the same bits prefilled whole, prefilled after a cached prefix, or decoded.
from types import SimpleNamespace
from services.scheduler.attention.backends import TritonAttnBackend
from services.scheduler.attention.paged import AttnMetadata, DecodeLayout, ExtendLayout

backend = TritonAttnBackend(torch.device("cpu"))
for dtype in (torch.float32, torch.bfloat16):
    n = 20
    kv = SimpleNamespace(k_buffer=[torch.zeros(128, 2, 16, dtype=dtype)],
                         v_buffer=[torch.zeros(128, 2, 16, dtype=dtype)])
    table = torch.zeros(2, 32, dtype=torch.int32)
    rows = torch.randperm(128)[:n]
    table[1, :n] = rows.int()
    q, k, v = torch.randn(n, 4, 16).to(dtype), torch.randn(n, 2, 16).to(dtype), torch.randn(n, 2, 16).to(dtype)

    def extend(prefix):
        m = n - prefix
        layout = ExtendLayout(torch.tensor([1]), torch.tensor([prefix]), torch.tensor([m]), torch.arange(m), m, n,
                              token_rows=torch.zeros(m, dtype=torch.long), token_slots=torch.full((m,), 1),
                              token_seq_lens=torch.arange(prefix + 1, n + 1))
        meta = AttnMetadata(rows[prefix:], table, m, extend=layout)
        return backend.forward(q[prefix:], k[prefix:], v[prefix:], 0, meta, kv, 0.25)

    whole, after_prefix = extend(0), extend(12)
    meta = AttnMetadata(rows[n - 1 :], table, 0, decode=DecodeLayout(torch.tensor([1]), torch.tensor([n]), n))
    decoded = backend.forward(q[n - 1 :], k[n - 1 :], v[n - 1 :], 0, meta, kv, 0.25)
    plain = extend_attention(q, kv.k_buffer[0], kv.v_buffer[0], table, torch.tensor([0]), torch.tensor([n]), 0.25,
                             block_m=8, block_n=4, req_slots=torch.tensor([1]))
    errors["deterministic " + str(dtype)] = [bool(torch.equal(whole[12:], after_prefix)),
                                            bool(torch.equal(whole[n - 1 :], decoded)),
                                            (whole.float() - plain.float()).abs().max().item()]
print(json.dumps(errors))
"""


def test_triton_attention_kernels_match_torch_references():
    errors = run_interpreted(CHECK)
    shape, dtype, err = errors["torch.float32"]
    assert shape == [3, 64] and dtype == "torch.float32" and err < 1e-5
    shape, dtype, err = errors["torch.bfloat16"]
    assert shape == [3, 64] and dtype == "torch.bfloat16" and err < 2e-2  # one bf16 rounding of the output
    shape, dtype, err = errors["extend torch.float32"]
    assert shape == [30, 64] and dtype == "torch.float32" and err < 1e-5
    # bf16 probabilities into the P@V product, then one bf16 rounding of the output.
    shape, dtype, err = errors["extend torch.bfloat16"]
    assert shape == [30, 64] and dtype == "torch.bfloat16" and err < 3e-2
    # Rows read in place through the req-to-token table and req slots: the same bits.
    assert [errors[f"{part}torch.{t}"] for part in ("slots ", "extend slots ") for t in ("float32", "bfloat16")] \
        == [True] * 4
    # Deterministic inference: bit-equal prefilled whole, after a cached prefix, and decoded;
    # the extend kernel's online softmax over other blocks agrees to rounding.
    same_split, same_decode, err = errors["deterministic torch.float32"]
    assert same_split and same_decode and err < 1e-5
    same_split, same_decode, err = errors["deterministic torch.bfloat16"]
    assert same_split and same_decode and err < 3e-2
