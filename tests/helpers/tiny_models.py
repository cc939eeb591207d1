"""Tiny random checkpoints of every architecture the scheduler serves, saved by transformers.

Shared by the model-family tests (``test_model_families``: against transformers' forward)
and the tensor-parallel ones (``test_tensor_parallel_archs``: N ranks against one).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    MixtralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
ARCHS = {
    "Qwen3ForCausalLM": (Qwen3Config, dict(head_dim=32, tie_word_embeddings=True)),
    # Layer 0 sparse, layer 1 dense (mlp_only_layers); top-2 renormalized.
    "Qwen3MoeForCausalLM": (Qwen3MoeConfig, dict(MOE, head_dim=32, num_experts=8, norm_topk_prob=True,
                                                 mlp_only_layers=[1])),
    # Layer 0 dense, layer 1 sparse (decoder_sparse_step 2); top-2 not renormalized; shared expert.
    "Qwen2MoeForCausalLM": (Qwen2MoeConfig, dict(MOE, num_experts=4, norm_topk_prob=False, decoder_sparse_step=2,
                                                 shared_expert_intermediate_size=48)),
    "MixtralForCausalLM": (MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    "Phi3ForCausalLM": (Phi3Config, dict(pad_token_id=0, eos_token_id=None, original_max_position_embeddings=96,
                                         rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                                                          "partial_rotary_factor": 0.5,
                                                          "short_factor": [1.0, 1.3, 2.0, 3.5],
                                                          "long_factor": [1.5, 2.5, 4.0, 8.0]})),
}
# Beyond the families above: Qwen2's biased q/k/v and tied embeddings; Gemma 3's sliding and
# global layers (window 8), one KV head, q/k norms, offset norms and soft-capped logits.
MORE = {
    "Qwen2ForCausalLM": (Qwen2Config, dict(rope_theta=1e6, tie_word_embeddings=True)),
    "Gemma3ForCausalLM": (Gemma3TextConfig, dict(num_key_value_heads=1, head_dim=16, sliding_window=8,
                                                 layer_types=["sliding_attention", "full_attention"],
                                                 query_pre_attn_scalar=24, final_logit_softcapping=15.0)),
}


def tiny_checkpoint(arch: str, root: Path) -> tuple[Path, torch.nn.Module]:
    """transformers' own model of ``arch`` at TINY shapes (seed 0; norm weights drawn around 1 so
    that q/k norms and the final norm matter), saved as safetensors under ``root``."""
    cls, extra = {**ARCHS, **MORE}[arch]
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cls(**{**TINY, **extra}), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    ref.generation_config.eos_token_id = None  # generate exactly STEPS tokens
    ref.generation_config.pad_token_id = 0
    ref.save_pretrained(root / arch)
    assert json.loads((root / arch / "config.json").read_text())["architectures"] == [arch]
    return root / arch, ref
