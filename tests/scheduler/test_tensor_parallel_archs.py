"""Tensor parallelism for every architecture: tp 2 gives the logits, tokens and logprobs of tp 1.

Each family's tiny random checkpoint (``tiny_models``, SmolLM2's tokenizer beside it) runs
three prompts (one prefilled in 16-token chunks beside running decodes, one asking for its
prompt logprobs) for 8 greedy tokens, on one rank and on two (rank 1 a spawned process,
``executor.tp``): every step's fp32 logits within 1e-4, the same tokens, output and prompt
logprobs. What each shards: Qwen2's biased q/k/v, Qwen3's q/k norms (per head, on the
rank's heads), Phi-3's fused checkpoint projections with partial rotary, Gemma 3's one KV
head replicated on both ranks beside its sliding-window layers, the experts of Qwen3-MoE,
Qwen2-MoE (with its shared expert) and Mixtral along their intermediate dim. Gemma 3 270M's
real weights too (a 262,144-token vocabulary split in two). Llama and SmolLM2 are
``test_tensor_parallel``'s.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from ringserve import models
from services.scheduler.config import EngineConfig, SchedulerConfig
from services.scheduler.executor.tp import TPGroup
from services.scheduler.models.config import ModelConfig
from tests.helpers.tiny_models import TINY, tiny_checkpoint
from tests.helpers.tp_runs import assert_same, run_engine, specs

ARCHS = ["Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM",
         "Qwen2MoeForCausalLM", "MixtralForCausalLM"]
PROMPTS = [[3, 14, 15, 92, 65], [(7 * i + 11) % 250 + 3 for i in range(40)], [200, 100, 50, 25, 12, 6, 3, 1, 9, 255]]


@pytest.fixture(scope="module")
def checkpoint(smollm2_dir: Path, tmp_path_factory):
    """arch -> a tiny checkpoint directory with SmolLM2's tokenizer files (made once per module)."""
    root = tmp_path_factory.mktemp("tp-archs")
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            path, _ = tiny_checkpoint(arch, root)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(smollm2_dir / name, path / name)
            made[arch] = path
        return made[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_equals_tp1(checkpoint, arch):
    path = checkpoint(arch)
    assert ModelConfig.from_hf(json.loads((path / "config.json").read_text())).architecture == arch
    run = lambda n: run_engine(path, n, specs(PROMPTS, 8, ignore_eos=True), "auto",  # noqa: E731
                               chunked_prefill_size=16, max_total_tokens=1024)
    one, two = run(1), run(2)
    assert all(len(r.output_ids) == 8 for r in one[0].values()) and len(one[0]["r0"].prompt_logprobs) == 4
    assert_same(one, two)


@pytest.mark.model  # reads the prepared Gemma 3 from the cache
def test_gemma3_270m_tp2_equals_tp1():
    """The real Gemma 3 270M (fp32 from the packaged GGUF): 4 query heads, one KV head, 18 layers."""
    path = models.prepare_gemma3_model(models.DEFAULT_CACHE)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompts = [tokenizer.encode(t).ids for t in ("The capital of France is", "def fibonacci(n):")]
    run = lambda n: run_engine(path, n, specs(prompts, 6, ignore_eos=True), "auto",  # noqa: E731
                               max_total_tokens=512, context_length=512)
    assert_same(run(1), run(2))


def test_sizes_that_do_not_divide_are_refused(checkpoint, tmp_path):
    """Every architecture shards; a size that does not divide its heads or its (expert)
    intermediate dims is refused by name, before any rank starts."""
    moe = dict(TINY, model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=30,
               shared_expert_intermediate_size=48)
    with pytest.raises(ValueError, match=r"^--tp-size 4 does not divide the model's MoE intermediate size 30$"):
        ModelConfig.from_hf(moe).check_tensor_parallel(4)
    shared_50 = ModelConfig.from_hf(dict(moe, moe_intermediate_size=32, shared_expert_intermediate_size=50))
    with pytest.raises(ValueError,
                       match=r"^--tp-size 4 does not divide the model's shared expert intermediate size 50$"):
        shared_50.check_tensor_parallel(4)
    ModelConfig.from_hf(dict(moe, moe_intermediate_size=32)).check_tensor_parallel(4)
    gemma = checkpoint("Gemma3ForCausalLM")
    with pytest.raises(ValueError, match=r"^--tp-size 3 does not divide the model's 4 attention heads$"):
        TPGroup.start(SchedulerConfig(engine=EngineConfig(model=gemma), tp_size=3))
    mixtral = dict(TINY, architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                   num_experts_per_tok=2, intermediate_size=34)
    (tmp_path / "config.json").write_text(json.dumps(mixtral))
    with pytest.raises(ValueError, match=r"^--tp-size 8 does not divide the model's 4 attention heads$"):
        TPGroup.start(SchedulerConfig(engine=EngineConfig(model=tmp_path), tp_size=8))
    with pytest.raises(ValueError, match=r"^--tp-size 4 does not divide the model's MoE intermediate size 34$"):
        TPGroup.start(SchedulerConfig(engine=EngineConfig(model=tmp_path), tp_size=4))
    assert not dist.is_initialized()
