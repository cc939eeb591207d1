"""The model contract: ``ModelConfig`` read from every family, the memory the engine sizes from
it, and the loader that refuses a checkpoint short of a weight."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.scheduler.config import EngineConfig
from services.scheduler.executor.build import activation_reserve_bytes
from services.scheduler.layers.parallel import TensorParallel
from services.scheduler.models import ARCHITECTURES, build_model, load_model
from services.scheduler.models.config import FAMILIES, ModelConfig
from services.scheduler.policy.kv_pool import GIB
from tests.helpers.tiny_models import TINY

QWEN3_MOE = dict(TINY, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])


def test_every_registered_architecture_has_a_family():
    assert set(ARCHITECTURES) == {name for name in FAMILIES if name[0].isupper()}


def test_families_read_into_one_shape(smollm2_dir):
    smollm2 = ModelConfig.from_hf(json.loads((smollm2_dir / "config.json").read_text()))
    assert (smollm2.num_attention_heads, smollm2.num_key_value_heads, smollm2.head_dim, smollm2.norm_style,
            smollm2.hidden_act, smollm2.qk_norm, smollm2.tie_word_embeddings) == (9, 3, 64, "rms", "silu", False, True)
    assert {(s.sliding_window, s.sparse) for s in smollm2.layers} == {(0, False)} and len(smollm2.layers) == 30
    moe = ModelConfig.from_hf(QWEN3_MOE)
    assert moe.qk_norm and [s.sparse for s in moe.layers] == [True, False] and moe.moe_intermediate_size == 32
    mixtral = ModelConfig.from_hf(dict(TINY, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2))
    assert (mixtral.architecture, mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == \
        ("MixtralForCausalLM", 4, 96, True)
    with pytest.raises(ValueError, match=r"^unsupported architectures \['GPT2LMHeadModel'\]; supported: "):
        ModelConfig.from_hf(dict(TINY, architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="sliding-window attention is not implemented"):
        ModelConfig.from_hf(dict(TINY, model_type="mistral", sliding_window=64))


def test_activation_reserve_is_sized_from_the_layers_widest_mlp(smollm2_dir):
    """SmolLM2 (dense): the figure the engine always reserved. A MoE layer's MLP is its router's
    logits, the top-k experts' 2 x moe_intermediate_size each and the shared expert: Qwen3-MoE
    here reserves for its dense layer (2 x 96 > 8 + 2 x 2 x 32), the same model with wider
    experts for them (the dense intermediate_size alone would give 192 columns)."""
    cfg = EngineConfig(model=Path("m"))
    tokens = min(cfg.max_prefill_tokens, cfg.chunked_prefill_size) + cfg.max_running_requests  # 2112
    smollm2 = ModelConfig.from_hf(json.loads((smollm2_dir / "config.json").read_text()))
    width = (9 + 2 * 3) * 64 + 2 * 1536 + 4 * 576
    assert activation_reserve_bytes(smollm2, cfg, torch.bfloat16) == \
        2 * tokens * width * 2 + 4 * 64 * 49152 * 4 + GIB // 2 == 640_729_088
    moe = ModelConfig.from_hf(QWEN3_MOE)
    assert moe.mlp_activation_width() == 2 * 96
    wide = ModelConfig.from_hf(dict(QWEN3_MOE, moe_intermediate_size=128))
    assert wide.mlp_activation_width() == 8 + 2 * 2 * 128
    attention_and_hidden = (4 + 2 * 2) * 16 + 4 * 64
    assert activation_reserve_bytes(wide, cfg, torch.float32) == \
        2 * tokens * (attention_and_hidden + 520) * 4 + 4 * 64 * 256 * 4 + GIB // 2


def test_kv_shape_is_this_ranks(smollm2_dir):
    hf = json.loads((smollm2_dir / "config.json").read_text())
    model = build_model(hf, torch.bfloat16, "torch", tp=TensorParallel(rank=2, size=3))
    shape = model.kv_shape()
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype) == (30, 1, 64, torch.bfloat16)
    assert shape.bytes_per_token() == 2 * 30 * 64 * 2
    assert model.layers[0].self_attn.qkv_proj.weight.shape == (3 * 64 + 2 * 64, 576)  # 3 q heads, k and v of one


def test_a_checkpoint_short_of_a_weight_is_refused(smollm2_dir, tmp_path):
    tensors = load_file(str(smollm2_dir / "model.safetensors"))
    shutil.copy(smollm2_dir / "config.json", tmp_path / "config.json")
    save_file({k: v for k, v in tensors.items() if k != "model.layers.3.self_attn.k_proj.weight"},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(RuntimeError, match=r"^missing weights: layers\.3\.self_attn\.qkv_proj\.weight \(parts k\)$"):
        load_model(tmp_path, torch.float32, attention_backend="torch")
    save_file({**tensors, "model.layers.3.self_attn.extra.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(RuntimeError, match=r"unexpected weights in .*: model\.layers\.3\.self_attn\.extra\.weight$"):
        load_model(tmp_path, torch.float32, attention_backend="torch")
