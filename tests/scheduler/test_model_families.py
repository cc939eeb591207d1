"""Qwen3, Qwen3-MoE, Qwen2-MoE, Mixtral and Phi-3: tiny random checkpoints saved by transformers,
served by the engine through the paged KV cache, against transformers' own forward.

Per architecture and attention backend (torch, cpu), five prompts go through a batched
prefill, a chunked prefill (a 40-token prompt in 16-token chunks beside running decodes),
decodes and a prefix-cache hit (the fifth prompt extends the first, added after it
finished). The reference is transformers' ``generate`` with its KV cache: for every
sampling row the engine's logits are within 1e-4 (fp32) of the reference's, and the 32
greedy tokens are identical. Phi-3 uses longrope (short factors and the attention factor
of an original context of 96 stretched to 128) with partial rotary. Its long factors are
checked against transformers' rotary module below: transformers' Phi-3 drops its KV cache
and recomputes the whole sequence once it grows past the original context, which a paged
cache does not do (``layers.rotary.RotaryEmbedding``), so no engine run crosses it here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from services.scheduler.config import EngineConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.layers.moe import moe_align_block_size
from services.scheduler.layers.rotary import RotaryEmbedding
from services.scheduler.models import load_model
from services.scheduler.models.blocks import SparseMoeBlock
from services.scheduler.policy.req import ReqInput, SamplingParams
from services.scheduler.policy.stops import load_eos_ids
from tests.helpers.tiny_models import ARCHS, TINY, tiny_checkpoint

MLPS = {"Qwen3MoeForCausalLM": ["SparseMoeBlock", "GatedMLP"], "Qwen2MoeForCausalLM": ["GatedMLP", "SparseMoeBlock"],
        "MixtralForCausalLM": ["SparseMoeBlock"] * 2}
CLASSES = {"Qwen3MoeForCausalLM": "MoeForCausalLM", "Qwen2MoeForCausalLM": "MoeForCausalLM",
           "MixtralForCausalLM": "MoeForCausalLM"}
PROMPTS = [[3, 14, 15, 92, 65, 35], [8, 9, 79], [200, 100, 50, 25, 12, 6, 3, 1, 0, 255],
           [(7 * i + 11) % 256 for i in range(40)]]
PREFIX_HIT = PROMPTS[0] + [42, 7, 99]
STEPS = 32


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch -> (checkpoint dir, {prompt: (reference logits [STEPS, V], greedy ids)}), built once per session."""
    root = tmp_path_factory.mktemp("archs")
    cache: dict[str, tuple[Path, dict]] = {}

    def get(arch: str):
        if arch not in cache:
            path, ref = tiny_checkpoint(arch, root)
            expected = {}
            with torch.no_grad():
                for ids in PROMPTS + [PREFIX_HIT]:
                    x = torch.tensor([ids])
                    out = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=STEPS,
                                       min_new_tokens=STEPS, output_logits=True, return_dict_in_generate=True)
                    expected[tuple(ids)] = (torch.cat(out.logits), out.sequences[0, len(ids):].tolist())
            cache[arch] = path, expected
        return cache[arch]

    return get


def serve(model: torch.nn.Module, model_dir: Path, smollm2_dir: Path, prompts: list[list[int]] = PROMPTS,
          **engine_cfg) -> dict:
    """``prompts`` (and PREFIX_HIT once they finished) through an engine over ``model``
    (SmolLM2's tokenizer: ids < 256 only); per rid its output ids, cached prompt tokens, and
    the logits [STEPS, V] of its sampling rows."""
    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    cfg = EngineConfig(model=model_dir, max_running_requests=8, max_total_tokens=1024, chunked_prefill_size=16, seed=0,
                       **engine_cfg)
    engine = Engine(model, tokenizer, load_eos_ids(smollm2_dir, tokenizer), cfg)
    got: dict = {"outputs": {}, "cached": {}, "rows": {}, "emitted": {}, "plans": []}
    sample, forward = engine.sampler.sample, engine.runner.forward

    def planned(plan, *args):
        got["plans"].append([plan.num_extend, len(plan.reqs), [r.rid for r in plan.reqs[: plan.num_extend]]])
        return forward(plan, *args)

    def recording(logits, reqs):
        for row, req in enumerate(reqs):
            got["rows"].setdefault(req.rid, []).append(logits[row].clone())
        return sample(logits, reqs)

    def drain():
        while engine.has_work:
            out = engine.step()
            if out is None:  # a step that emitted nothing (no row sampled)
                continue
            pos = 0
            for row, rid in enumerate(out.rids):
                n = out.new_token_counts[row]
                got["outputs"].setdefault(rid, []).extend(out.output_ids[pos : pos + n])
                got["emitted"][rid] = got["emitted"].get(rid, 0) + 1
                got["cached"][rid] = out.cached_tokens[row]
                pos += n

    engine.sampler.sample = recording
    engine.runner.forward = planned
    params = SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(ReqInput(rid=f"p{i}", input_ids=ids, sampling=params))
    drain()
    engine.add_request(ReqInput(rid="hit", input_ids=PREFIX_HIT, sampling=params))
    drain()
    got["rows"] = {rid: torch.stack(r) for rid, r in got["rows"].items()}
    got["deterministic"] = engine.deterministic
    return got


def assert_matches(got: dict, expected: dict, tol: float = 1e-4) -> None:
    """Every request's 32 greedy tokens equal the reference's; its logits within ``tol``."""
    assert got["cached"]["hit"] == len(PROMPTS[0])  # p0's prompt, from the radix cache
    # p3's 40 tokens in 16-token chunks, the last ones beside running decodes.
    assert sum("p3" in rids for _, _, rids in got["plans"]) == 3
    assert any(n_ext and n > n_ext for n_ext, n, _ in got["plans"])
    assert set(got["emitted"].values()) == {STEPS}  # one row per sampled token: no prefill chunk emits
    for rid, ids in zip([f"p{i}" for i in range(len(PROMPTS))] + ["hit"], PROMPTS + [PREFIX_HIT], strict=True):
        ref_logits, ref_ids = expected[tuple(ids)]
        assert got["outputs"][rid] == ref_ids, rid
        assert got["rows"][rid].shape == ref_logits.shape == (STEPS, TINY["vocab_size"])
        assert (got["rows"][rid] - ref_logits).abs().max().item() < tol, rid


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_engine_matches_transformers(arch, backend, checkpoints, smollm2_dir):
    path, expected = checkpoints(arch)
    model = load_model(path, torch.float32, attention_backend=backend)
    assert type(model).__name__ == CLASSES.get(arch, "LlamaForCausalLM") and model.config.architecture == arch
    assert [type(layer.mlp).__name__ for layer in model.layers] == MLPS.get(arch, ["GatedMLP"] * 2)
    assert_matches(serve(model, path, smollm2_dir), expected)


TRITON = r"""
import json, sys, torch
from pathlib import Path
from services.scheduler.kernels import triton_moe
from services.scheduler.layers.activation import silu_and_mul
from services.scheduler.layers.moe import fused_experts_cpu, select_experts, stacked_expert
from services.scheduler.models import load_model
from services.scheduler.models.blocks import SparseMoeBlock
from tests.scheduler.test_model_families import serve

path, smollm2_dir, out = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
kernel = {}
# I = 48: N = 96 and K = 48 are not multiples of the 64 x 32 tiles (masked edges).
E, K, H, I = 8, 2, 64, 48
for dtype in (torch.float32, torch.bfloat16):
    w13, w2 = (torch.randn(E, 2 * I, H) * 0.1).to(dtype), (torch.randn(E, H, I) * 0.1).to(dtype)
    for t in (1, 7, 40):
        x = torch.randn(t, H).to(dtype)
        weights, ids = select_experts(torch.randn(t, E), K, renormalize=t != 7)
        a = triton_moe.fused_experts(x, w13, w2, weights, ids, silu_and_mul)
        b = fused_experts_cpu(x, weights, ids, E, stacked_expert(w13, w2, silu_and_mul))
        kernel[f"{dtype}-{t}"] = [a.dtype == dtype, (a.float() - b.float()).abs().max().item(), b.abs().max().item()]
model = load_model(path, torch.float32, attention_backend="triton")
blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
for m in blocks:  # the CUDA path, on CPU tensors under the interpreter
    m.fused_experts = triton_moe.fused_experts
got = serve(model, path, smollm2_dir)
torch.save(got, out)
print(json.dumps({"interpreted": triton_moe.interpreted(), "blocks": len(blocks), "kernel": kernel,
                  "attention": type(model.attn_backend).__name__}))
"""


def test_triton_moe_and_attention_under_the_interpreter(checkpoints, smollm2_dir, tmp_path):
    """The Triton grouped GEMM equals the CPU expert path (fp32 to rounding, bf16 within
    bf16's steps) at 1, 7 and 40 tokens; and Qwen3-MoE served with Triton attention and
    Triton experts (interpreter, CPU tensors) matches transformers like the other backends."""
    path, expected = checkpoints("Qwen3MoeForCausalLM")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", TRITON, str(path), str(smollm2_dir), str(tmp_path / "got.pt")],
                          cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["interpreted"] and report["blocks"] == 1 and report["attention"] == "TritonAttnBackend"
    for key, (same_dtype, diff, scale) in report["kernel"].items():
        assert same_dtype and scale > 0.1, key
        assert diff < (1e-5 if "float32" in key else 0.02 * scale), (key, diff, scale)
    assert_matches(torch.load(tmp_path / "got.pt"), expected)


def test_expert_block_layout():
    """Pairs sorted by expert, each expert's run padded to whole blocks with the sentinel T*K."""
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # pairs 0..5 -> experts 2 0 2 3 0 2
    sorted_ids, block_experts, num_rows = moe_align_block_size(ids, num_experts=5, block_m=4)
    pad = 6  # 6 pairs + 5 experts x 3 pad rows at most = 21 rows, rounded up to 6 blocks of 4
    assert sorted_ids.tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad] + [pad] * 12
    assert num_rows.tolist() == [12]  # blocks 3.. are idle; their expert is clamped to a valid one
    assert block_experts.tolist() == [0, 2, 3, 4, 4, 4]


def test_moe_block_on_fake_cuda_tensors(monkeypatch):
    """On a CUDA device the block takes the Triton path, and routing plus the block layout run
    on the device without a host sync (fake CUDA tensors raise on any data-dependent read);
    the two grouped GEMMs get device tensors only."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from services.scheduler.attention.backends import TorchAttnBackend
    from services.scheduler.executor.device import CudaRuntime
    from services.scheduler.kernels import triton_moe
    from services.scheduler.layers.parallel import TensorParallel
    from services.scheduler.models.base import LayerEnv
    from services.scheduler.models.blocks import SparseMoeBlock
    from services.scheduler.models.config import ModelConfig

    cuda = torch.device("cuda:0")
    calls = []

    def checked(a, b, layout, num_pairs, top_k, block, weights=None):
        for t in (a, b, *layout, *([] if weights is None else [weights])):
            assert t.device == cuda
        calls.append((tuple(a.shape), top_k, block))
        return torch.empty(num_pairs, b.shape[1], dtype=a.dtype, device=a.device)

    monkeypatch.setattr(triton_moe, "grouped_gemm", checked)
    hf = dict(TINY, model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48)
    with FakeTensorMode(allow_non_fake_inputs=False), torch.inference_mode():  # as ModelRunner.forward
        with torch.device(cuda):
            env = LayerEnv(TensorParallel(), TorchAttnBackend(cuda), torch.float32, cuda,
                           fused_experts=CudaRuntime(cuda).fused_experts())
            block = SparseMoeBlock(ModelConfig.from_hf(hf), env)
            out = block(torch.empty(5, 64))
    assert block.fused_experts is triton_moe.fused_experts
    assert out.device == cuda and tuple(out.shape) == (5, 64)
    assert calls == [((5, 64), 2, (16, 64, 32)), ((10, 32), 1, (16, 64, 32))]


ROPES = {
    "default": (LlamaConfig, {"rope_type": "default", "rope_theta": 1e4}),
    "linear": (LlamaConfig, {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}),
    "llama3": (LlamaConfig, {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "longrope-partial": (Phi3Config, {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                      "short_factor": [1.0, 1.3, 2.0, 3.5, 5.0, 6.0, 7.0, 9.0],
                                      "long_factor": [1.5, 2.5, 4.0, 8.0, 9.0, 12.0, 20.0, 31.0]}),
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rotary_tables_match_transformers(kind):
    """cos/sin rows equal transformers' rotary module's (its rotated dims) at every position:
    below the original context with the short factors, past it with the long ones (longrope)."""
    cls, rope = ROPES[kind]
    hf = cls(hidden_size=128, num_attention_heads=4, max_position_embeddings=128, rope_parameters=dict(rope),
             **({"original_max_position_embeddings": 64} if cls is Phi3Config else {}))
    module = (Phi3RotaryEmbedding if cls is Phi3Config else LlamaRotaryEmbedding)(hf)
    ours = load_config_rotary(hf)
    rot = int(32 * rope.get("partial_rotary_factor", 1.0))
    spans = [(0, 64), (64, 128)] if cls is Phi3Config else [(0, 128)]
    for lo, hi in spans:
        cos, sin = module(torch.zeros(1), torch.arange(lo, hi).unsqueeze(0))  # [1, n, rot]; long when hi > 64
        for got, want in ((ours.cos, cos[0]), (ours.sin, sin[0])):
            assert (got[lo:hi, : rot // 2] - want[:, : rot // 2]).abs().max() < 1e-6, lo
            assert torch.equal(got[lo:hi, : rot // 2], got[lo:hi, 16 : 16 + rot // 2])  # rotate_half pairs
    if rot < 32:  # pass-through dims do not turn
        assert (ours.cos[:, rot // 2 : 16] == 1).all() and (ours.sin[:, rot // 2 : 16] == 0).all()


def load_config_rotary(hf) -> RotaryEmbedding:
    """ringserve's rotary tables for an HF config object, through the model's config reader."""
    from services.scheduler.models.config import ModelConfig

    cfg = ModelConfig.from_hf({**hf.to_dict(), "intermediate_size": 1, "num_hidden_layers": 1})
    rope = cfg.layers[0].rope
    return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, rope.theta, rope.scaling)


@pytest.mark.parametrize("kind", ["yarn", "dynamic"])
def test_unsupported_rope_type_is_named(tmp_path, kind):
    hf = dict(TINY, architectures=["LlamaForCausalLM"], rope_parameters={"rope_type": kind, "rope_theta": 1e4,
                                                                        "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError,
                       match=f"unsupported rope_type '{kind}'; supported: default, linear, llama3, longrope"):
        load_model(tmp_path, torch.float32, "dummy")


def test_bench_moe_preset_runs_the_engine(smollm2_dir, capsys, tmp_path):
    """``bench/engine.py --preset qwen3-moe-small``: a Qwen3-MoE of the preset's shape with random
    weights and SmolLM2's tokenizer, timed at batch 1 and 2."""
    from bench import engine
    model = load_model(engine.preset_dir(smollm2_dir, "qwen3-moe-small", tmp_path), torch.bfloat16, "dummy")
    assert model.config.architecture == "Qwen3MoeForCausalLM" and model.config.vocab_size == 49152
    blocks = [layer.mlp for layer in model.layers]
    assert all(isinstance(b, SparseMoeBlock) for b in blocks) and len(blocks) == 4
    assert tuple(blocks[0].experts.gate_up.shape) == (16, 384, 512) and blocks[0].top_k == 4
    rows = engine.main(["--model", str(smollm2_dir), "--preset", "qwen3-moe-small", "--dtype", "bfloat16",
                       "--batch", "1", "2", "--steps", "2", "--prompt-len", "8"])
    assert [(r["model"], r["batch"], r["dtype"]) for r in rows] == [("qwen3-moe-small", 1, "bfloat16"),
                                                                  ("qwen3-moe-small", 2, "bfloat16")]
    assert all(r["step_ms"] > 0 for r in rows)
    assert "batch=2 prompt_len=8: decode step" in capsys.readouterr().out


def _bf16_block(tokens: int):
    """A CPU Qwen3-MoE block (8 experts of 32, top 2, hidden 64) with seeded random bf16 weights,
    and an input [tokens, 64]."""
    from services.scheduler.attention.backends import TorchAttnBackend
    from services.scheduler.layers.parallel import TensorParallel
    from services.scheduler.models.base import LayerEnv
    from services.scheduler.models.config import ModelConfig

    hf = dict(TINY, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    cpu = torch.device("cpu")
    env = LayerEnv(TensorParallel(), TorchAttnBackend(cpu), torch.float32, cpu)
    block = SparseMoeBlock(ModelConfig.from_hf(hf), env)
    gen = torch.Generator().manual_seed(0)
    for p in (block.gate.weight, block.experts.gate_up, block.experts.down):
        p.data = (torch.randn(p.shape, generator=gen) * 0.1).bfloat16()
    return block, torch.randn(tokens, 64, generator=gen).bfloat16()


def test_packed_experts_give_the_stacked_weights_bits():
    """bf16 on the CPU: the experts' oneDNN-packed weights (``pack_linears``) give the same bits as
    the stacked weights, and packing twice packs nothing."""
    from services.scheduler.layers.linear import can_pack, pack_linears

    block, x = _bf16_block(tokens=9)
    with torch.inference_mode():
        before = block(x)
        assert block.experts.packed is None
        if not can_pack(block.experts.gate_up):  # oneDNN without bf16 (a CPU without AVX-512-BF16/AMX)
            assert pack_linears(block) == 0 and block.experts.packed is None and torch.equal(block(x), before)
            return
        assert pack_linears(block) == 1 + 2 * 8 and pack_linears(block) == 0  # router + two per expert
        after = block(x)
    assert block.experts.packed is not None and torch.equal(before, after)


def test_moe_deterministic_inference_is_batch_invariant(checkpoints, smollm2_dir):
    """bf16 Qwen3-MoE on the cpu backend with deterministic inference: a request's logits have the
    same bits alone as beside four others (which change how many rows each expert runs), chunked
    or not; the experts were probed for their row floor like the dense linears."""
    path, _ = checkpoints("Qwen3MoeForCausalLM")
    model = load_model(path, torch.bfloat16, attention_backend="cpu")
    alone = serve(model, path, smollm2_dir, prompts=[PROMPTS[3]], deterministic_inference=True)
    together = serve(model, path, smollm2_dir, prompts=[PROMPTS[3], *PROMPTS[:3]], deterministic_inference=True)
    assert alone["deterministic"] and together["deterministic"]
    experts = model.layers[0].mlp.experts
    from services.scheduler.layers.linear import can_pack

    assert (experts.packed is not None) == can_pack(experts.gate_up) and experts.window.floor >= 1
    assert alone["outputs"]["p0"] == together["outputs"]["p0"]
    assert torch.equal(alone["rows"]["p0"], together["rows"]["p0"])
    assert torch.equal(alone["rows"]["hit"], together["rows"]["hit"])


def test_expert_row_floor_pads_every_expert_call(monkeypatch):
    """Where the probe finds a GEMM floor for the experts' shapes, ``make_batch_invariant`` sets it
    on the layer's experts and every expert matmul then runs at least that many rows."""
    from services.scheduler.layers import batch_invariant, linear, moe

    block, x = _bf16_block(tokens=3)
    with torch.inference_mode():
        before = block(x)
        packed = linear.pack_linears(block) > 0  # 0 where oneDNN has no bf16: the stacked weights run
        window = batch_invariant.RowWindow
        monkeypatch.setattr(batch_invariant, "probe", lambda i, o, *args: window(5, 128) if (i, o) == (64, 64) else
                            window(2, 256) if (i, o) == (32, 64) else window(1, 256))
        wrapped = batch_invariant.make_batch_invariant(block)
        assert wrapped["experts"] == window(5, 128) and block.experts.window == window(5, 128)
        assert all(w == window(1, 256) for name, w in wrapped.items() if name != "experts")
        assert batch_invariant.make_batch_invariant(block) == {}
        seen = []
        if packed:
            real = moe.packed_linear
            monkeypatch.setattr(moe, "packed_linear", lambda rows, w: seen.append(rows.shape[0]) or real(rows, w))
        else:
            stacked = moe.stacked_expert

            def counting(*args):
                run = stacked(*args)
                return lambda e, rows: seen.append(rows.shape[0]) or run(e, rows)

            monkeypatch.setattr(moe, "stacked_expert", counting)
        after = block(x)
    assert seen and min(seen) == 5  # 3 tokens x top-2 over 8 experts: every expert has < 5 rows
    assert (after.float() - before.float()).abs().max() < 0.02
