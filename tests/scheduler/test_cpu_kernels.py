"""The cpu backend's C kernels (``kernels.cpu_kernels``) against the torch ops they replace.

Element-wise kernels must give the torch path's bits in bf16 (rotary and the K/V store
exactly in fp32 too); decode attention is checked against an fp32 softmax reference,
over requests of different lengths, for head sizes with an AVX-512 path (64, 128, 256) and
one without (32, the portable loop), plain and with a sliding window and soft-capping.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.scheduler.attention import backends
from services.scheduler.attention.backends import create_attention_backend
from services.scheduler.attention.paged import AttnMetadata, DecodeLayout
from services.scheduler.executor.device import create_runtime
from services.scheduler.executor.model_runner import ModelRunner
from services.scheduler.kernels import cpu_kernels
from services.scheduler.layers.norm import RMSNorm
from services.scheduler.layers.rotary import apply_rotary_packed, rotate_qkv
from services.scheduler.models import blocks, dummy_model
from services.scheduler.policy.kv_pool import ReqToTokenPool, TokenToKVPool
from services.scheduler.policy.req import Req, ReqInput
from services.scheduler.policy.schedule import SchedulePolicy


def _reference_decode(q, k_buf, v_buf, kv_indices, seq_lens, scale, window=0, softcap=0.0):
    """fp32 attention, request by request: [B, Hq, D] float32; ``window`` > 0 keeps each
    request's last ``window`` keys, ``softcap`` > 0 caps the scores (cap * tanh(s / cap))."""
    b, hq, d = q.shape
    g = hq // k_buf.shape[1]
    out = torch.empty(b, hq, d)
    for i in range(b):
        length = int(seq_lens[i])
        rows = kv_indices[i, max(0, length - window) if window else 0: length]
        k = k_buf[rows].float().repeat_interleave(g, dim=1)  # [L, Hq, D]
        v = v_buf[rows].float().repeat_interleave(g, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].float(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        probs = torch.softmax(scores, dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", probs, v)
    return out


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (8, 2.0)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 32])
def test_decode_attention_matches_fp32_softmax_reference(dtype, tol, head_dim, window, softcap):
    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, n = 5, 9, 3, 300
    q = torch.randn(b, hq, head_dim, generator=gen).to(dtype)
    k_buf = torch.randn(n, hkv, head_dim, generator=gen).to(dtype)
    v_buf = torch.randn(n, hkv, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor([37, 1, 20, 16, 33])
    kv_indices = torch.stack([torch.randperm(n, generator=gen)[:37] for _ in range(b)])
    got = cpu_kernels.decode_attention(q, k_buf, v_buf, kv_indices, seq_lens, head_dim**-0.5, window=window,
                                       softcap=softcap)
    want = _reference_decode(q, k_buf, v_buf, kv_indices, seq_lens, head_dim**-0.5, window, softcap)
    assert got.dtype == dtype and got.shape == (b, hq, head_dim)
    assert (got.float() - want).abs().max().item() < tol
    # A one-key request attends to exactly its value row.
    assert torch.equal(got[1], v_buf[kv_indices[1, 0]].repeat_interleave(3, dim=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_gives_the_torch_rotation_and_store_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(1)
    t, hq, hkv, d, n = 7, 9, 3, 64, 50
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    angles = torch.rand(t, 1, d, generator=gen) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    loc = torch.randperm(n, generator=gen)[:t]
    k_buf, v_buf = torch.zeros(n, hkv, d, dtype=dtype), torch.zeros(n, hkv, d, dtype=dtype)
    q = cpu_kernels.rotary_store(qkv, cos, sin, loc, k_buf, v_buf, hq)
    qk, v = qkv.split([(hq + hkv) * d, hkv * d], dim=-1)
    want = apply_rotary_packed(qk.reshape(t, hq + hkv, d), cos, sin)
    assert torch.equal(q, want[:, :hq])
    assert torch.equal(k_buf[loc], want[:, hq:]) and torch.equal(v_buf[loc], v.reshape(t, hkv, d))
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[loc] = False
    assert int(k_buf[untouched].count_nonzero()) == 0 and int(v_buf[untouched].count_nonzero()) == 0


def test_add_rms_norm_and_silu_give_the_torch_bits_in_bf16():
    gen = torch.Generator().manual_seed(2)
    t, h = 33, 576  # more than 16 rows: the threaded loop
    x = torch.randn(t, h, generator=gen).bfloat16()
    residual = torch.randn(t, h, generator=gen).bfloat16()
    norm = RMSNorm(h, 1e-5).bfloat16()
    norm.weight.data = torch.randn(h, generator=gen).bfloat16()
    want_residual = residual + x
    updated = residual.clone()
    assert torch.equal(cpu_kernels.add_rms_norm(x, norm.weight, 1e-5, updated), norm(want_residual))
    assert torch.equal(updated, want_residual)
    assert torch.equal(cpu_kernels.add_rms_norm(x, norm.weight, 1e-5), norm(x))
    gate_up = (torch.randn(t, 2 * 1536, generator=gen) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(cpu_kernels.silu_and_mul(gate_up), F.silu(gate) * up)


def test_add_rms_norm_and_silu_in_fp32_agree_to_rounding():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    want = weight * F.rms_norm(x, (576,), eps=1e-6)
    assert (cpu_kernels.add_rms_norm(x, weight, 1e-6) - want).abs().max().item() < 1e-5
    gate_up = torch.randn(4, 200, generator=gen) * 4  # 100 columns: a vector loop and a tail
    gate, up = gate_up.chunk(2, dim=-1)
    assert (cpu_kernels.silu_and_mul(gate_up) - F.silu(gate) * up).abs().max().item() < 1e-5


def test_kernels_refuse_mixed_dtypes_and_other_dtypes():
    q = torch.zeros(1, 3, 64)
    pool = torch.zeros(4, 3, 64, dtype=torch.bfloat16)
    idx, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="must share a dtype"):
        cpu_kernels.decode_attention(q, pool, pool, idx, lens, 0.125)
    with pytest.raises(ValueError, match="bfloat16 or float32 tensors, got torch.float16"):
        cpu_kernels.silu_and_mul(torch.zeros(1, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        cpu_kernels.silu_and_mul(torch.zeros(4, 2).t())


def test_library_is_built_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path))
    path = cpu_kernels.build()
    assert path.parent == tmp_path / "kernels" and path.suffix == ".so"
    mtime = path.stat().st_mtime_ns
    assert cpu_kernels.build() == path and path.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary left behind


def test_every_source_file_keys_the_library_and_every_c_file_is_in_it(tmp_path, monkeypatch):
    """One library per content of every file of ``cpu/`` (a header's too), built from all of its ``.c`` files."""
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "cpu"
    shutil.copytree(cpu_kernels.SOURCE_DIR, src)
    monkeypatch.setattr(cpu_kernels, "SOURCE_DIR", src)
    names = [p.name for p in cpu_kernels.sources()]
    assert names == ["amx.c", "attention.c", "common.h", "decoder.c", "elementwise.c", "int8.c", "int8.h", "parallel.c"]
    paths = [cpu_kernels.library_path()]
    for name in names:
        with open(src / name, "a") as f:
            f.write("/* edited */\n")
        paths.append(cpu_kernels.library_path())
    assert len(set(paths)) == len(names) + 1
    lib = ctypes.CDLL(str(cpu_kernels.build()))
    assert cpu_kernels.build() == paths[-1]
    for symbol in ("rs_decode_attention", "rs_rotary_store", "rs_add_rms_norm", "rs_silu_and_mul", "rs_int8_linear",
                   "rs_int8_available", "rs_w8_bf16_available", "rs_w8_amx_available", "rs_w8a8_amx_available",
                   "rs_argmax", "rs_decoder_layers", "rs_set_pool", "rs_pool_threads"):
        assert hasattr(lib, symbol), symbol


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 17), (5, 1), (64, 1000), (70, 33)])
def test_argmax_gives_torchs_indices_with_ties_nans_and_infinities(rows, vocab):
    """Each row's index of torch.argmax: the first of equal maxima (also +0.0 against -0.0), the
    first NaN where a row has one, -inf rows; vocabularies off the vector width."""
    gen = torch.Generator().manual_seed(rows * 1000 + vocab)
    x = torch.randn(rows, vocab, generator=gen)
    x[0, vocab // 2:] = x[0].max() + 1.0  # a tie from the middle on: the middle wins
    if rows > 1:
        x[1] = -torch.inf
    if rows > 2:
        x[2, -1] = torch.nan
        x[2, 0] = torch.inf
    if rows > 3:
        x[3] = 0.0
        x[3, ::2] = -0.0
    if rows > 4:
        x[4, vocab // 3] = torch.nan
        x[4, -1] = torch.nan
    got = cpu_kernels.argmax(x)
    assert got.dtype == torch.int64
    assert got.tolist() == x.argmax(dim=-1).tolist()
    assert cpu_kernels.argmax(x[:, :1].contiguous()).tolist() == [0] * rows


def test_a_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(cpu_kernels.KernelBuildError, match="C compiler 'no-such-cc' not usable"):
        cpu_kernels.build()


def test_decode_attention_reads_no_key_past_its_row():
    """A length past the index row reads only the row; a request with no keys gets zeros."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 64, generator=gen).bfloat16()
    pool = torch.randn(8, 1, 64, generator=gen).bfloat16()
    kv_indices = torch.tensor([[0, 1, 2], [3, 4, 5]])
    got = cpu_kernels.decode_attention(q, pool, pool, kv_indices, torch.tensor([1_000_000, 0]), 0.125)
    full = cpu_kernels.decode_attention(q[:1], pool, pool, kv_indices[:1], torch.tensor([3]), 0.125)
    assert torch.equal(got[0], full[0]) and int(got[1].count_nonzero()) == 0


def test_auto_backend_falls_back_to_torch_without_a_compiler(tmp_path):
    script = ("import logging, torch; logging.basicConfig(level=logging.WARNING)\n"
              "from services.scheduler.attention.backends import create_attention_backend\n"
              "from services.scheduler.executor.device import create_runtime\n"
              "print(create_attention_backend('auto', create_runtime(torch.device('cpu'))).name)\n")
    env = dict(os.environ, CC="no-such-cc", RINGSERVE_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "torch"
    assert "attention backend 'cpu' unavailable, using 'torch': C compiler 'no-such-cc' not usable" in proc.stderr


def test_the_backend_logs_which_kernels_it_runs(caplog):
    with caplog.at_level("INFO", logger="services.scheduler.attention.backends"):
        cpu = create_runtime(torch.device("cpu"))
        assert create_attention_backend("auto", cpu).name == "cpu"
        assert create_attention_backend("torch", cpu).name == "torch"
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("attention backend cpu: C kernels ") and messages[0].endswith(".so")
    assert messages[1] == "attention backend torch on cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_fuses_rotary_with_the_store_and_gives_the_models_rotation_bits(dtype):
    """The cpu backend declares ``fuses_rotary``: given the un-rotated projection, its one C call
    (rotary and the K/V store) gives the output and pool of the model's own rotation
    (``layers.rotary.rotate_qkv``) followed by ``forward``; a backend that does not fuse refuses."""
    gen = torch.Generator().manual_seed(3)
    b, hq, hkv, d, n = 4, 9, 3, 64, 40
    qkv = torch.randn(b, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    angles = torch.rand(b, 1, d, generator=gen) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    table = torch.randperm(n, generator=gen)[: b * 8].view(b, 8).to(torch.int32)
    seq_lens = torch.tensor([8, 3, 5, 1])
    loc = table[torch.arange(b), seq_lens - 1].long()
    pools = []
    outs = []
    backend = create_attention_backend("cpu", create_runtime(torch.device("cpu")))
    assert backend.fuses_rotary and backend.fused_ops is not None
    for fused in (True, False):
        kv = type("KV", (), {})()
        base = torch.randn(n, hkv, d, generator=torch.Generator().manual_seed(4)).to(dtype)
        kv.k_buffer, kv.v_buffer = [base.clone()], [base.clone()]
        meta = AttnMetadata(loc, table, 0, decode=DecodeLayout(torch.arange(b), seq_lens, 8))
        backend.init_forward_metadata(meta)
        if fused:
            outs.append(backend.forward_rotary(qkv, cos, sin, hq, 0, meta, kv, d**-0.5))
        else:
            outs.append(backend.forward(*rotate_qkv(qkv, cos, sin, hq, hkv, d), 0, meta, kv, d**-0.5))
        pools.append((kv.k_buffer[0], kv.v_buffer[0]))
    assert torch.equal(outs[0], outs[1]) and outs[0].shape == (b, hq * d)
    assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])
    torch_backend = create_attention_backend("torch", create_runtime(torch.device("cpu")))
    assert not torch_backend.fuses_rotary and torch_backend.fused_ops is None
    with pytest.raises(NotImplementedError, match="attention backend 'torch' does not fuse rotary"):
        torch_backend.forward_rotary(qkv, cos, sin, hq, 0, meta, kv, d**-0.5)


@pytest.mark.parametrize("backend,fused", [("cpu", True), ("torch", False)])
def test_the_model_hands_a_fusing_backend_the_unrotated_projection(smollm2_dir, monkeypatch, backend, fused):
    """Each attention layer calls the backend's fused rotary where it declares one, and rotates
    in torch otherwise: one call per layer per step either way, never both."""
    hf = {**json.loads((smollm2_dir / "config.json").read_text()), "num_hidden_layers": 2}
    model = dummy_model(hf, torch.float32, attention_backend=backend)
    calls = {"fused": 0, "torch": 0}
    rotate = blocks.rotate_qkv
    monkeypatch.setattr(blocks, "rotate_qkv", lambda *a: calls.__setitem__("torch", calls["torch"] + 1) or rotate(*a))
    real = backends.CpuAttnBackend.forward_rotary
    monkeypatch.setattr(backends.CpuAttnBackend, "forward_rotary",
                        lambda self, *a: calls.__setitem__("fused", calls["fused"] + 1) or real(self, *a))
    shape = model.kv_shape()
    req_pool, kv_pool = ReqToTokenPool(2, 64), TokenToKVPool(64, shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                                              shape.dtype)
    policy = SchedulePolicy(req_pool, kv_pool, 2, 64)
    policy.waiting.append(Req(ReqInput(rid="a", input_ids=[1, 2, 3])))
    with torch.inference_mode():
        logits = ModelRunner(model, req_pool, kv_pool).forward(policy.schedule())
    assert logits.shape == (1, 49152)
    assert calls == ({"fused": 2, "torch": 0} if fused else {"fused": 0, "torch": 2})
