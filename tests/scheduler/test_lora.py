"""Multi-LoRA in the engine against transformers + peft (merged adapters), fp32.

Three PEFT adapters of different ranks, targets and scalings are made here with peft on
SmolLM2's shapes; one batch holds rows of all three and of the base model, prefilled in
chunks, decoded, and sent again to hit the prefix cache. Every row's logits equal those of
transformers running the adapter merged into the weights, within 1e-4.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.scheduler.config import EngineConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.layers.cpu_linear import amx_bf16_available
from services.scheduler.lora.adapter import AdapterError
from services.scheduler.models import load_model
from services.scheduler.policy.stops import load_eos_ids

# name -> (LoraConfig keywords): attention only; all seven with rsLoRA; MLP and o_proj.
ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all": dict(r=4, lora_alpha=8, use_rslora=True,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"]),
}
PROMPTS = [  # the second is prefilled in two chunks (--chunked-prefill-size 24)
    "The capital of France is",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n\nprint(",
]


@pytest.fixture(scope="module")
def adapters(smollm2_dir, tmp_path_factory):
    """{name: (adapter directory, transformers model with the adapter merged)} plus the base under None."""
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    out = {None: (None, base)}
    root = tmp_path_factory.mktemp("lora")
    for seed, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kw))
        with torch.no_grad():  # peft's random B is as large as A; keep the change visible but moderate
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.05)
        model.save_pretrained(root / name)
        out[name] = (root / name, model.merge_and_unload().eval())
    return out


@pytest.fixture(scope="module")
def lora_engine(smollm2_dir, tokenizer, adapters):
    """An engine on its own copy of the model (the wrapped linears stay out of the shared one)."""
    cfg = EngineConfig(model=smollm2_dir, max_running_requests=16, max_total_tokens=8192, seed=0,
                       chunked_prefill_size=24, max_loras=4, max_lora_rank=16,
                       lora_modules=tuple(f"{n}={adapters[n][0]}" for n in ADAPTERS))
    model = load_model(smollm2_dir, torch.float32)
    return Engine(model, tokenizer, load_eos_ids(smollm2_dir, tokenizer), cfg)


def test_batch_of_three_adapters_and_base_matches_merged_peft(lora_engine, tokenizer, adapters, greedy_req,
                                                              run_all):
    engine = lora_engine
    rows = []  # (adapter name, the request, tokens whose last one's logits the row holds, the row)
    kinds = {"extend": 0, "decode": 0, "chunk": 0}
    forward = engine.runner.forward

    def recorded(plan, future=None):
        logits = forward(plan, future)
        for row, (req, p, n) in enumerate(zip(plan.reqs, plan.prefix_lens, plan.extend_lens, strict=True)):
            rows.append((req.lora.name if req.lora is not None else None, req, p + n, logits[row].clone()))
            kinds["decode" if row >= plan.num_extend else "chunk" if p + n < len(req.fill_ids()) else "extend"] += 1
        return logits

    engine.runner.forward = recorded
    names = [None, *ADAPTERS]
    try:
        for wave in range(2):  # the second wave finds the first's prompts in the prefix cache
            for i, text in enumerate(PROMPTS):
                for j, name in enumerate(names):
                    engine.add_request(replace(greedy_req(f"w{wave}-{i}-{j}", tokenizer.encode(text).ids,
                                                          max_new_tokens=2, ignore_eos=True),
                                               lora_name=name or ""))
            results = run_all(engine)
            assert all(r.finish is not None and r.finish.type == 2 for r in results.values())
            cached = {rid: r.cached_tokens for rid, r in results.items()}
            if wave == 0:  # the same prompt under another adapter shares no KV
                assert set(cached.values()) == {0}
            else:
                assert all(c > 0 for c in cached.values()), cached
    finally:
        engine.runner.forward = forward
    # One reference forward per (adapter, tokens): the second wave's rows repeat the first's.
    references: dict[tuple, torch.Tensor] = {}
    worst: dict[str | None, float] = {}
    for name, req, length, got in rows:
        key = (name, tuple(req.fill_ids()[:length]))
        if key not in references:
            with torch.no_grad():
                references[key] = adapters[name][1](torch.tensor([key[1]])).logits[0, -1]
        worst[name] = max(worst.get(name, 0.0), (references[key] - got).abs().max().item())
    assert set(worst) == set(names)
    assert max(worst.values()) < 1e-4, worst
    assert kinds["chunk"] > 0 and kinds["decode"] > 0 and kinds["extend"] > 0
    # Each adapter changes the model: its merged reference is not the base.
    ids = torch.tensor([tokenizer.encode(PROMPTS[0]).ids])
    with torch.no_grad():
        base = adapters[None][1](ids).logits
        assert all((adapters[n][1](ids).logits - base).abs().max() > 1e-2 for n in ADAPTERS)
    assert {a.refs for a in engine.lora.by_name.values()} == {0}


def test_unknown_adapter_is_not_found(lora_engine, tokenizer, greedy_req, run_all):
    lora_engine.add_request(replace(greedy_req("nope", [1, 2, 3]), lora_name="missing"))
    result = run_all(lora_engine)["nope"]
    assert (result.finish.status, result.finish.message) == ("NOT_FOUND", "The model 'missing' does not exist")


def write_adapter(path, config: dict, tensors: dict[str, torch.Tensor]):
    """A PEFT-format directory by hand: for the cases peft itself would not write."""
    import json

    from safetensors.torch import save_file

    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "lora_alpha": 8, **config}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return str(path)


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize(("config", "tensors", "message"), [
    ({"r": 32, "target_modules": ["q_proj"]}, {}, "rank 32 is over --max-lora-rank 16"),
    ({"r": 4, "target_modules": ["q_proj", "lm_head"]}, {}, r"unknown target module\(s\) \['lm_head'\]"),
    ({"r": 4, "target_modules": ["q_proj"]}, {Q_A: torch.zeros(4, 576), Q_B: torch.zeros(575, 4)},
     r"has shape \[575, 4\], expected \[576, 4\]"),
    ({"r": 4, "target_modules": ["q_proj"]}, {Q_A: torch.zeros(4, 576)}, "lora_A without its pair"),
    ({"r": 4, "target_modules": ["q_proj"], "use_dora": True}, {}, "use_dora=True is not supported"),
    ({"r": 4, "target_modules": ["q_proj"]}, {Q_A.replace("layers.0", "layers.30"): torch.zeros(4, 576)},
     "for layer 30; the model has 30"),
])
def test_bad_adapters_are_refused_by_name(lora_engine, tmp_path, config, tensors, message):
    registry = lora_engine.lora
    path = write_adapter(tmp_path / "bad", config, tensors or {Q_A: torch.zeros(4, 576)})
    with pytest.raises(AdapterError, match=message):
        registry.load("bad", path)
    assert list(registry.by_name) == list(ADAPTERS) and len(registry.by_slot) == len(ADAPTERS)


def test_missing_adapter_and_limits(lora_engine, adapters, tmp_path):
    registry = lora_engine.lora
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        registry.load("x", str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="'qv' is already loaded"):
        registry.load("qv", str(adapters["qv"][0]))
    registry.load("qv2", str(adapters["qv"][0]))  # the fourth slot
    with pytest.raises(ValueError, match="4 adapters are resident"):
        registry.load("qv3", str(adapters["qv"][0]))
    assert registry.unload("qv2") is True
    assert list(registry.by_name) == list(ADAPTERS) and len(registry.by_slot) == len(ADAPTERS)


def test_unload_in_use_waits_for_the_request(lora_engine, tokenizer, adapters, greedy_req, run_all):
    """An adapter unloaded while a request runs on it: the request finishes on it, its slot frees after."""
    engine, registry = lora_engine, lora_engine.lora
    registry.load("late", str(adapters["mlp"][0]))
    ids = tokenizer.encode(PROMPTS[0]).ids
    engine.add_request(replace(greedy_req("late", ids, max_new_tokens=4, ignore_eos=True), lora_name="late"))
    engine.add_request(replace(greedy_req("mlp", ids, max_new_tokens=4, ignore_eos=True), lora_name="mlp"))
    engine.step()
    slot = registry.by_name["late"].slot
    assert registry.unload("late") is False and slot in registry.by_slot
    results = run_all(engine)
    assert results["late"].output_ids == results["mlp"].output_ids  # the same weights, to the end
    assert slot not in registry.by_slot and "late" not in registry.by_name


@pytest.mark.skipif(not amx_bf16_available(), reason="no AMX-BF16: bf16 runs on oneDNN and its layers from Python")
def test_the_first_adapter_takes_a_bf16_model_out_of_its_one_c_call(smollm2_dir, tokenizer, adapters, greedy_req,
                                                                    run_all):
    """bf16 on AMX runs a step's layers in one C call, which would bypass LoRA's wrappers: loading
    the first adapter undoes it, and the adapter's row then differs from the base row."""
    cfg = EngineConfig(model=smollm2_dir, dtype="bfloat16", max_running_requests=4, max_total_tokens=2048, seed=0,
                       max_loras=2, max_lora_rank=16)
    model = load_model(smollm2_dir, torch.bfloat16)
    engine = Engine(model, tokenizer, load_eos_ids(smollm2_dir, tokenizer), cfg)
    assert model.cpu_fused
    engine.lora.load("all", str(adapters["all"][0]))
    assert not model.cpu_fused
    ids = tokenizer.encode(PROMPTS[0]).ids
    engine.add_request(replace(greedy_req("base", ids, max_new_tokens=3, ignore_eos=True), return_logprob=True))
    engine.add_request(replace(greedy_req("all", ids, max_new_tokens=3, ignore_eos=True), return_logprob=True,
                               lora_name="all"))
    results = run_all(engine)
    assert results["base"].logprobs != results["all"].logprobs
