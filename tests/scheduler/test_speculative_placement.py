"""The speculative step on a CUDA device without a GPU (fake CUDA tensors, as in
test_device_placement): drafted rows extend beside plain decodes and prompt chunks, the
verification and the rejection sampler run on the device, the KV rows of rejected drafts
come back, and nothing reads the device but the runtime's copies."""

from __future__ import annotations

import json

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from services.scheduler.config import EngineConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.executor.cuda_graph import DecodeGraphRunner
from services.scheduler.models import dummy_model
from services.scheduler.policy.req import FinishType, ReqInput, SamplingParams
from services.scheduler.policy.stops import load_eos_ids
from tests.scheduler.test_device_placement import CUDA, CheckedTritonKernels, FakeCudaRuntime


def test_speculative_steps_on_fake_cuda_tensors(smollm2_dir, tokenizer):
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    token = tokenizer.token_to_id("Ġthe")
    runtime = FakeCudaRuntime(mode, token)
    cfg = EngineConfig(model=smollm2_dir, max_running_requests=8, max_total_tokens=256, chunked_prefill_size=32,
                       attention_backend="triton", disable_cuda_graph=True, speculative_algorithm="ngram")
    hf = {**json.loads((smollm2_dir / "config.json").read_text()), "num_hidden_layers": 2}
    with mode:
        model = dummy_model(hf, torch.bfloat16, seed=None, attention_backend="triton", runtime=runtime)
        kernels = model.attn_backend.kernels = CheckedTritonKernels()
        engine = Engine(model, tokenizer, load_eos_ids(smollm2_dir, tokenizer), cfg, runtime)
        engine.runner.graph_runner = DecodeGraphRunner(model, runtime, engine.req_pool, engine.kv_pool, 4,
                                                       capture=False)
        assert not engine.overlap  # the next plan needs the accepted count on the host
        prompt = tokenizer.encode("the the the quick brown fox and the lazy dog").ids
        finish = {}
        engine.add_request(ReqInput(rid="greedy", input_ids=prompt, return_logprob=True, top_logprobs_num=2,
                                    sampling=SamplingParams(temperature=0.0, max_new_tokens=8)))
        engine.add_request(ReqInput(rid="sampled", input_ids=prompt[:6], sampling=SamplingParams(
            temperature=0.8, top_p=0.9, top_k=20, logit_bias=((5, 1.0),), max_new_tokens=8)))
        steps = 0
        while engine.has_work:
            out = engine.step()
            steps += 1
            if steps == 2:  # a prompt prefilled in two chunks beside the drafted rows
                engine.add_request(ReqInput(rid="late", input_ids=(prompt * 5)[:45],
                                            sampling=SamplingParams(temperature=0.0, max_new_tokens=4)))
            for i, rid in enumerate(out.rids if out is not None else []):
                finish[rid] = out.finish_reasons[i]
    assert {rid: f.type for rid, f in finish.items()} == dict.fromkeys(("greedy", "sampled", "late"),
                                                                         FinishType.LENGTH)
    stats = engine.speculator.stats
    assert stats.verify_rows > 0 and stats.proposed > 0
    load = engine.load()
    assert (load.req_slots_used, load.kv_used_tokens) == (0, 0)
    assert load.kv_cached_tokens + engine.kv_pool.available == 256
    assert kernels.calls["extend_attention"] > 0
    assert {p.device for p in model.parameters()} == {CUDA}
