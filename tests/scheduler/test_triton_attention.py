"""The Triton decode and extend attention kernels against torch references, on CPU tensors under
Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is imported, hence
the subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHECK = r"""
import json, torch
from services.scheduler.layers.attention import _decode
from services.scheduler.layers.triton_attention import decode_attention, extend_attention

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
        k, v = k_buf[rows].float().repeat_interleave(2, 1), v_buf[rows].float().repeat_interleave(2, 1)  # GQA groups of 2
        scores = torch.einsum("thd,khd->htk", q[start : start + n].float(), k) * 0.25
        causal = torch.arange(p + n)[None, :] <= (p + torch.arange(n))[:, None]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        want.append(torch.einsum("htk,khd->thd", probs, v).reshape(n, -1))
        start += n
    errors["extend " + str(dtype)] = [list(got.shape), str(got.dtype), (got.float() - torch.cat(want)).abs().max().item()]
print(json.dumps(errors))
"""


def test_triton_attention_kernels_match_torch_references():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", CHECK], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    errors = json.loads(proc.stdout.strip().splitlines()[-1])
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
