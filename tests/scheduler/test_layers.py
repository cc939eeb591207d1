"""The fast layer paths (decode attention, packed rotary, fused RMSNorm) against their
plain formulas, on SmolLM2's real K/V cache and hidden states."""

from __future__ import annotations

import copy

import torch

from services.scheduler.attention.paged import _decode
from services.scheduler.layers.rotary import _rotate_half, apply_rotary_packed


def _prefilled(make_engine, greedy_req, tokenizer, prompts):
    """Prefill ``prompts`` in a fresh fp32 engine; returns it with every request running."""
    engine = make_engine()
    for i, text in enumerate(prompts):
        engine.add_request(greedy_req(f"r{i}", tokenizer.encode(text).ids, max_new_tokens=4))
    while len(engine.policy.running) < len(prompts):
        engine.step()
    return engine


def _reference_decode(q, k_buf, v_buf, kv_indices, seq_lens, scale):
    """Per-request fp32 attention with KV heads repeated (transformers' repeat_kv)."""
    hq, hkv = q.shape[1], k_buf.shape[1]
    outs = []
    for b in range(q.shape[0]):
        rows = kv_indices[b, : seq_lens[b]]
        k = k_buf[rows].float().repeat_interleave(hq // hkv, 1)  # [L, Hq, D]
        v = v_buf[rows].float().repeat_interleave(hq // hkv, 1)
        probs = (torch.einsum("hd,lhd->hl", q[b].float(), k) * scale).softmax(-1)
        outs.append(torch.einsum("hl,lhd->hd", probs, v).reshape(-1))
    return torch.stack(outs)


def test_decode_attention_matches_per_request_reference(make_engine, greedy_req, tokenizer):
    prompts = ["The capital of France is", "One two three four five six seven eight nine ten", "Hi"]
    engine = _prefilled(make_engine, greedy_req, tokenizer, prompts)
    reqs = engine.policy.running
    seq_lens = [r.kv_len for r in reqs]
    assert len(set(seq_lens)) == 3  # unequal lengths: the padded keys must be masked
    slots = torch.tensor([r.req_slot for r in reqs])
    kv_indices = engine.req_pool.req_to_token[slots, : max(seq_lens)].long()
    valid = torch.arange(max(seq_lens))[None, :] < torch.tensor(seq_lens)[:, None]
    mask = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))[:, None, None, :]
    k_buf, v_buf = engine.kv_pool.k_buffer[7], engine.kv_pool.v_buffer[7]  # real K/V of layer 7
    q = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(0))
    want = _reference_decode(q, k_buf, v_buf, kv_indices, seq_lens, 0.125)

    got = _decode(q, k_buf, v_buf, kv_indices, mask, 0.125)
    assert got.shape == (3, 576) and got.dtype == torch.float32
    assert (got - want).abs().max().item() < 1e-5

    # Every request as long as the longest: no mask at all.
    full = torch.tensor([max(seq_lens)] * 3)
    want_full = _reference_decode(q, k_buf, v_buf, kv_indices, full, 0.125)
    assert (_decode(q, k_buf, v_buf, kv_indices, None, 0.125) - want_full).abs().max().item() < 1e-5

    # bf16 cache: matmuls in bf16 with fp32 softmax, within bf16 rounding of the fp32 result.
    got16 = _decode(q.bfloat16(), k_buf.bfloat16(), v_buf.bfloat16(), kv_indices, mask, 0.125)
    assert got16.shape == (3, 576) and got16.dtype == torch.bfloat16
    assert (got16.float() - want).abs().max().item() < 3e-2


@torch.inference_mode()
def test_packed_rotary_equals_rotating_q_and_k_separately(sched_model):
    positions = torch.tensor([0, 5, 17, 300])
    cos, sin = sched_model.rotaries[0](positions, torch.float32)
    qk = torch.randn(4, 12, 64, generator=torch.Generator().manual_seed(1))  # 9 q heads + 3 k heads
    q, k = qk[:, :9], qk[:, 9:]
    want = torch.cat((q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin), dim=1)
    assert torch.equal(apply_rotary_packed(qk, cos, sin), want)


@torch.inference_mode()
def test_rms_norm_equals_the_transformers_formula(sched_model):
    h = sched_model.embed_tokens(torch.tensor([1, 42, 4000, 49151]))  # real hidden states
    for dtype in (torch.float32, torch.bfloat16):
        norm = copy.deepcopy(sched_model.layers[0].input_layernorm).to(dtype)
        x = h.to(dtype)
        hf = x.float()
        want = norm.weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + norm.eps)).to(dtype)
        got = norm(x)
        assert got.dtype == dtype and torch.equal(got, want)


@torch.inference_mode()
def test_packed_linear_is_bit_identical_to_nn_linear(smollm2_dir, monkeypatch):
    from services.scheduler.layers import linear
    from services.scheduler.layers.linear import PackedLinear, can_pack, pack_linears
    from services.scheduler.models import load_model

    monkeypatch.setattr(linear, "can_run_amx_bf16", lambda weight: False)  # oneDNN's packing, also on AMX

    model = load_model(smollm2_dir, torch.bfloat16)
    mlp = model.layers[3].mlp
    x = model.embed_tokens(torch.tensor([[5, 900, 20000]]).view(-1))  # [3, 576] real hidden states
    want = [mlp.gate_up_proj(x), model.lm_head(x)]
    if not can_pack(mlp.gate_up_proj.weight):  # oneDNN without bf16 (a CPU without AVX-512-BF16/AMX)
        assert pack_linears(model) == 0 and not isinstance(mlp.gate_up_proj, PackedLinear)
        assert torch.equal(mlp.gate_up_proj(x), want[0])
        return
    assert pack_linears(model) == 30 * 4 + 1  # qkv, o, gate_up, down per layer, and the LM head
    assert pack_linears(model) == 0
    assert isinstance(mlp.gate_up_proj, PackedLinear)
    for m in (3, 1):  # several rows and a single row through the same packed weight
        got = [mlp.gate_up_proj(x[:m]), model.lm_head(x[:m])]
        assert all(g.dtype == torch.bfloat16 and torch.equal(g, w[:m]) for g, w in zip(got, want, strict=True))
    assert torch.equal(model.embed_tokens.weight, load_model(smollm2_dir, torch.bfloat16).embed_tokens.weight)
