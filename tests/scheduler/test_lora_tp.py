"""LoRA adapters under tensor parallelism (gloo, CPU): each rank holds its shard of A and B as
its base layers shard their weights, so 2 ranks give the logits of one, for rows of two
adapters (one loaded at start, one at run time and sent to the other ranks) and of the base."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.helpers.tp_runs import assert_same, run_engine, specs

# 8 query heads of 16 and 2 KV heads, intermediate 256: every adaptable linear splits over 2 ranks.
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49155, hidden_size=128,
            intermediate_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)
SHAPES = {"q_proj": (128, 128), "k_proj": (128, 32), "v_proj": (128, 32), "o_proj": (128, 128),
          "gate_proj": (128, 256), "up_proj": (128, 256), "down_proj": (256, 128)}


def write_adapter(path: Path, rank: int, seed: int) -> str:
    """Every adaptable module of both layers, random A and B (strong enough to change the logits)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(2):
        for module, (fan_in, fan_out) in SHAPES.items():
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.2
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.2
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(SHAPES)}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def tiny_dir(smollm2_dir: Path, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny-llama-lora")
    (d / "config.json").write_text(json.dumps(TINY))
    shutil.copy(smollm2_dir / "tokenizer.json", d / "tokenizer.json")
    return d


def test_adapters_at_tp2_equal_tp1(tiny_dir, tmp_path):
    static, dynamic = write_adapter(tmp_path / "a", 4, 1), write_adapter(tmp_path / "b", 8, 2)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 49152, (20,), generator=gen).tolist()
    reqs = [replace(r, lora_name=name) for r, name in zip(specs([prompt] * 3, 4), ("", "a", "b"), strict=True)]

    def run(tp_size: int):
        return run_engine(tiny_dir, tp_size, reqs, "dummy", prepare=lambda e: e.lora.load("b", dynamic),
                          lora_modules=(f"a={static}",), max_total_tokens=1024)

    one = run(1)
    assert_same(one, run(2))
    logprobs = [one[0][rid].logprobs for rid in ("r0", "r1", "r2")]
    assert logprobs[0] != logprobs[1] != logprobs[2] != logprobs[0]  # each adapter changes the model
