"""Config-flag variants of the Llama family (Qwen2 q/k/v bias, Mistral, llama3 rope scaling,
untied LM head) and bf16: tiny random checkpoints against transformers' reference."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from services.scheduler.executor.model_runner import ModelRunner
from services.scheduler.models import load_model
from services.scheduler.policy.kv_pool import ReqToTokenPool, TokenToKVPool
from services.scheduler.policy.req import Req, ReqInput
from services.scheduler.policy.schedule import SchedulePolicy

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
VARIANTS = {
    "qwen2": (Qwen2Config, dict(rope_theta=1e6, tie_word_embeddings=True)),
    "mistral": (MistralConfig, dict(sliding_window=None, head_dim=32, tie_word_embeddings=False)),
    "llama3-rope": (LlamaConfig, dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 64})),
}


def paged_logits(model, prompts: list[list[int]], decode_steps: int) -> list[list[torch.Tensor]]:
    """Batched prefill then greedy decode on the paged KV cache; per request, last-token logits per step."""
    c = model.config
    req_pool = ReqToTokenPool(8, 256)
    dtype = next(model.parameters()).dtype
    kv_pool = TokenToKVPool(1024, c.num_hidden_layers, c.num_key_value_heads, c.head_dim, dtype)
    policy = SchedulePolicy(req_pool, kv_pool, 8, 1024)
    runner = ModelRunner(model, req_pool, kv_pool)
    reqs = [Req(ReqInput(rid=str(i), input_ids=p)) for i, p in enumerate(prompts)]
    policy.waiting.extend(reqs)
    seen: list[list[tuple[list[int], torch.Tensor]]] = [[] for _ in reqs]
    for _ in range(decode_steps + 1):
        plan = policy.schedule()
        logits = runner.forward(plan)
        for row, req in enumerate(plan.reqs):
            req.kv_len += plan.extend_lens[row]
            seen[int(req.rid)].append((req.fill_ids(), logits[row]))
            req.append_output(int(logits[row].argmax()))
    return seen


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_matches_reference(tmp_path, name):
    cls, extra = VARIANTS[name]
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cls(**TINY, **extra), dtype=torch.float32).eval()
    ref.save_pretrained(tmp_path)
    arch = json.loads((tmp_path / "config.json").read_text())["architectures"]
    model = load_model(tmp_path, torch.float32)
    assert model.config.attention_bias == (name == "qwen2"), arch
    prompts = [[3, 14, 15, 92, 65, 35], [8, 9, 79], [200, 100, 50, 25, 12, 6, 3, 1, 0, 255]]
    for steps in paged_logits(model, prompts, decode_steps=3):
        for ids, logits in steps:
            with torch.no_grad():
                expected = ref(torch.tensor([ids])).logits[0, -1]
            assert (expected - logits).abs().max().item() < 1e-4


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: .*'LlamaForCausalLM'"):
        load_model(tmp_path, torch.float32)


def test_bfloat16_agrees_with_float32(smollm2_dir, sched_model, tokenizer):
    bf16 = load_model(smollm2_dir, torch.bfloat16)
    prompts = [tokenizer.encode(t).ids for t in ("The capital of France is", "2 + 2 =")]
    low = paged_logits(bf16, prompts, decode_steps=2)
    full = paged_logits(sched_model, prompts, decode_steps=2)
    for lo, hi in zip(low, full, strict=True):
        assert lo[0][1].dtype == torch.float32  # logits leave the model in fp32 whatever the weights
        assert int(lo[0][1].argmax()) == int(hi[0][1].argmax())
        assert (lo[0][1] - hi[0][1]).abs().max().item() < 1.0


def test_dummy_load_format_needs_only_a_config(tmp_path):
    hf = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **TINY}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    a = load_model(tmp_path, torch.bfloat16, "dummy")
    b = load_model(tmp_path, torch.bfloat16, "dummy")
    assert a.config.attention_bias and next(a.parameters()).dtype == torch.bfloat16
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    steps = paged_logits(a, [[1, 2, 3], [4, 5]], decode_steps=2)
    assert all(logits.shape == (256,) and torch.isfinite(logits).all() for s in steps for _, logits in s)
    with pytest.raises(ValueError, match="unknown load format 'gguf'"):
        load_model(tmp_path, torch.float32, "gguf")
