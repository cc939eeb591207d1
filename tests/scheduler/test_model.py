"""The native Llama model on the paged KV cache against transformers' reference (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8,",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def test_logits_match_reference_through_paged_kv(make_engine, tokenizer, reference, greedy_req):
    engine = make_engine()
    for i, text in enumerate(PROMPTS):
        engine.add_request(greedy_req(f"p{i}", tokenizer.encode(text).ids, max_new_tokens=6, ignore_eos=True))
    checked = {"extend": 0, "decode": 0}
    worst = [0.0]
    forward = engine.runner.forward

    def compared(plan, future=None):
        logits = forward(plan, future)
        for row, req in enumerate(plan.reqs):
            with torch.no_grad():
                ref = reference(torch.tensor([req.fill_ids()])).logits[0, -1]
            worst[0] = max(worst[0], (ref - logits[row]).abs().max().item())
        checked["decode" if plan.is_decode else "extend"] += len(plan.reqs)
        return logits

    engine.runner.forward = compared
    while engine.has_work:
        engine.step()
    # One batched prefill of all five prompts (padded extend), then five decode steps.
    assert checked == {"extend": 5, "decode": 25}
    assert worst[0] < 1e-3


def test_greedy_matches_reference_generate(make_engine, tokenizer, reference, greedy_req, run_all):
    engine = make_engine()
    expected = {}
    for i, text in enumerate(PROMPTS):
        ids = tokenizer.encode(text).ids
        engine.add_request(greedy_req(f"g{i}", ids, max_new_tokens=32))
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32)
        expected[f"g{i}"] = out[0, len(ids):].tolist()
    results = run_all(engine)
    assert {rid: r.output_ids for rid, r in results.items()} == expected
