"""Tensor parallelism on the CPU (gloo): N ranks give the logits and tokens of one.

Rank 0 is this test process (an Engine, as the scheduler builds it); ranks 1..N-1 are the
processes ``TPGroup.start`` spawns, running ``executor.tp.worker_main``. Every step's logits
are compared with the same engine at ``--tp-size 1`` (fp32: within 1e-4), and the greedy
tokens, output logprobs and prompt logprobs must match.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from services.scheduler.config import EngineConfig, SchedulerConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.executor.tp import TPGroup
from services.scheduler.models.config import ModelConfig
from tests.helpers.engine_steps import collect, greedy
from tests.helpers.tp_runs import assert_same, run_engine, specs

# 8 query heads, 2 KV heads (split at 2 ranks, replicated at 4), q/k/v bias, and a
# vocabulary (SmolLM2's 49152 ids + 3) that 2 and 4 do not divide: the last shard is padded.
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49155, hidden_size=128,
            intermediate_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=True,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tiny_dir(smollm2_dir: Path, tmp_path_factory) -> Path:
    """A dummy-weights Llama directory: TINY's config.json beside SmolLM2's tokenizer."""
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(TINY))
    shutil.copy(smollm2_dir / "tokenizer.json", d / "tokenizer.json")
    return d


@pytest.mark.parametrize("tp_size", [2, 4])
def test_dummy_llama_tp_equals_tp1(tiny_dir, tp_size):
    """Chunked prefill (chunks of 32 beside running decodes) and prompt logprobs on the way."""
    gen = torch.Generator().manual_seed(tp_size)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 45, 70)]
    run = lambda n: run_engine(tiny_dir, n, specs(prompts, 8), "dummy", chunked_prefill_size=32,  # noqa: E731
                               max_total_tokens=2048)
    assert_same(run(1), run(tp_size))


def test_smollm2_tp3_equals_tp1(smollm2_dir, chat_ids):
    """SmolLM2's 9 query heads, 3 KV heads and intermediate size 1536 over 3 ranks."""
    questions = ["What is the capital of France?", "Name three colors.", "Count to five.",
                 "Write a haiku about the sea.", "What is 2 + 2?"]
    prompts = [chat_ids(q) for q in questions]
    run = lambda n: run_engine(smollm2_dir, n, specs(prompts, 6), "auto", max_total_tokens=4096)  # noqa: E731
    assert_same(run(1), run(3))


def test_sizes_that_do_not_divide_are_refused():
    cfg = ModelConfig.from_hf(dict(TINY, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536))
    with pytest.raises(ValueError, match="--tp-size 2 does not divide the model's 9 attention heads"):
        cfg.check_tensor_parallel(2)
    with pytest.raises(ValueError, match="--tp-size 6 is not a multiple of the model's 4 KV heads"):
        ModelConfig.from_hf(dict(TINY, num_attention_heads=12, num_key_value_heads=4)).check_tensor_parallel(6)
    with pytest.raises(ValueError, match="does not divide the model's intermediate size 250"):
        ModelConfig.from_hf(dict(TINY, intermediate_size=250)).check_tensor_parallel(4)
    cfg.check_tensor_parallel(3)


def test_refused_before_any_rank_starts(smollm2_dir, tmp_path):
    with pytest.raises(ValueError, match="--tp-size 2 does not divide the model's 9 attention heads"):
        TPGroup.start(SchedulerConfig(engine=EngineConfig(model=smollm2_dir), tp_size=2))
    assert not dist.is_initialized()


def test_launcher_gives_each_replica_its_ranks_devices_and_port():
    from ringserve.launch import Launcher, parse_args

    launcher = Launcher(parse_args(["--model", "m", "--replicas", "2", "--tp-size", "4", "--device", "cuda",
                                    "--dist-port", "29500", "--chunked-prefill-size", "512"]))
    args = [launcher._scheduler_args("1", "d", i) for i in range(2)]
    for i, a in enumerate(args):
        flags = dict(zip(a[::2], a[1::2], strict=True))
        assert (flags["--tp-size"], flags["--device"], flags["--dist-port"], flags["--chunked-prefill-size"]) == \
            ("4", f"cuda:{4 * i}", str(29500 + i), "512")
    single = Launcher(parse_args(["--model", "m"]))._scheduler_args("1", "d", 0)
    assert "--tp-size" not in single and "--dist-port" not in single


def test_deterministic_inference_at_tp3_in_bf16(smollm2_dir, chat_ids):
    """bf16 at tp 3 (deterministic inference on by default): a prompt alone on a cold engine and
    the same prompt once cached among five others give the same ids and logprobs, and so does a
    prompt first run in that batch and then alone -- the all-reduce sums in rank order
    (``TensorParallel.fixed_order``), not in the ring's size-dependent chunks."""
    cfg = SchedulerConfig(engine=EngineConfig(model=smollm2_dir, dtype="bfloat16", seed=0, max_running_requests=8,
                                              max_total_tokens=4096),
                          tp_size=3, torch_threads=1, dist_timeout_s=60)
    prompts = {f"q{i}": chat_ids(q) for i, q in enumerate(["Describe a cat.", "Name a river.", "What is rain?",
                                                           "Say hello.", "Why is grass green?", "Count to three."])}
    group = TPGroup.start(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine.from_config(cfg.engine, group.tp)
        group.attach(engine)
        assert engine.deterministic and engine.tp.fixed_order

        def run(rids: list[str], tag: str) -> dict:
            for rid in rids:
                engine.add_request(replace(greedy(f"{rid}-{tag}", prompts[rid], 12), return_logprob=True))
            results: dict = {}
            while engine.has_work:
                out = engine.step()
                if out is not None:
                    collect(out, results)
            return {rid.split("-")[0]: (r.output_ids, r.logprobs) for rid, r in results.items()}

        alone = run(["q0"], "alone")
        batch = run(list(prompts), "batch")
        again = run(["q1"], "again")
    finally:
        torch.set_num_threads(threads)
        group.stop()
    assert batch["q0"] == alone["q0"] and len(alone["q0"][0]) == 12
    assert again["q1"] == batch["q1"]
