"""Gemma 3 (services/scheduler/models/gemma3.py) against transformers' Gemma3ForCausalLM.

A tiny random checkpoint saved by transformers: sliding and global layers (window 8, prompts
up to 40 tokens), one KV head, q/k norms with random weights, final-logit soft-capping,
linear rope scaling on the global layers, and an ``attn_logit_softcapping`` that Gemma 3
does not apply (transformers' neither). It runs through the engine (paged KV cache, chunked
prefill of 16-token chunks, radix prefix cache, greedy decode of 32 tokens) on each
attention backend; every step's logits are compared with transformers' eager forward over
the same tokens, and every greedy token with the reference's argmax. A second run switches
the backends' attention soft-capping on and compares with transformers' eager attention
given the same ``softcap``.
Triton runs under its interpreter in a subprocess (TRITON_INTERPRET must be set before
triton is imported).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.scheduler.config import EngineConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.models import load_model
from services.scheduler.models.config import ModelConfig
from services.scheduler.policy.req import ReqInput, SamplingParams

WINDOW = 8
STEPS = 32
# Wave 1 fills the prefix cache; wave 2's prompts share 24 and 20 leading tokens with it.
WAVE1 = [[(7 * i + 3) % 290 + 5 for i in range(40)], [8, 9, 79, 4, 100], list(range(200, 222))]
WAVE2 = [WAVE1[0][:24] + [11, 12, 13, 14, 15, 16, 17], WAVE1[2][:20] + [1, 2, 3]]


def tiny_config():
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=128, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=24,
        attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    cfg._attn_implementation = "eager"  # the attention that applies the soft-capping
    return cfg


@pytest.fixture(scope="module")
def gemma_tiny(tmp_path_factory):
    """(checkpoint dir, transformers reference model): random weights, random norm weights
    (transformers initializes them to zero, which would hide a missing ``1 +``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp("gemma3-tiny")
    ref.save_pretrained(path)
    return path, ref


def run_engine(model_dir: Path, backend: str, window: int | None = None,
               softcap: float = 0.0) -> tuple[dict[str, list[int]], dict[str, int], list]:
    """Serve WAVE1 then WAVE2 greedily on the engine; returns (outputs by rid, cached tokens by
    rid, [(rid, context ids, float32 logits [vocab])] of every row the model computed).
    ``window`` replaces the sliding layers' window (a mutation check); ``softcap`` sets every
    layer's attention soft-capping."""
    from tokenizers import Tokenizer, models

    model = load_model(model_dir, torch.float32, attention_backend=backend)
    for layer in model.layers:
        layer.self_attn.softcap = softcap
        if window is not None and layer.self_attn.window:
            layer.self_attn.window = window
    cfg = EngineConfig(model=model_dir, max_running_requests=8, max_total_tokens=2048, seed=0,
                       chunked_prefill_size=16, max_prefill_tokens=64)
    engine = Engine(model, Tokenizer(models.BPE()), frozenset(), replace(cfg))
    rows: list = []
    forward = engine.runner.forward

    def recording(plan, future=None):
        logits = forward(plan, future)
        for i, req in enumerate(plan.reqs):
            end = plan.prefix_lens[i] + plan.extend_lens[i]
            rows.append((req.rid, req.fill_ids()[:end], logits[i].clone()))
        return logits

    engine.runner.forward = recording
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for wave, prompts in (("a", WAVE1), ("b", WAVE2)):
        for i, ids in enumerate(prompts):
            sampling = SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True)
            engine.add_request(ReqInput(rid=f"{wave}{i}", input_ids=ids, sampling=sampling))
        while engine.has_work:
            out = engine.step()
            if out is None:
                continue
            pos = 0
            for row, rid in enumerate(out.rids):
                n = out.new_token_counts[row]
                outputs.setdefault(rid, []).extend(out.output_ids[pos: pos + n])
                pos += n
                cached[rid] = out.cached_tokens[row]
    return outputs, cached, rows


def check(ref, prompts: dict[str, list[int]], result, softcap: float = 0.0) -> float:
    """Assert ``result`` (``run_engine``'s) against transformers (its eager attention with
    ``softcap`` when given); returns the largest logit error."""
    outputs, cached, rows = result
    assert cached["b0"] >= 16 and cached["b1"] >= 16, cached  # prefix-cache hits past the window
    full = {}
    for rid, prompt in prompts.items():
        seq = prompt + outputs[rid]
        assert len(outputs[rid]) == STEPS
        with torch.no_grad():
            kwargs = {"softcap": softcap} if softcap else {}
            full[rid] = ref(torch.tensor([seq]), **kwargs).logits[0]  # [len, vocab]: logits after each prefix
        # Greedy tokens: each output is the reference's argmax after the tokens before it.
        assert outputs[rid] == full[rid][len(prompt) - 1: -1].argmax(-1).tolist(), rid
    worst = 0.0
    kinds = set()
    for rid, ctx, logits in rows:
        expected = full[rid][len(ctx) - 1]
        worst = max(worst, (expected - logits).abs().max().item())
        kinds.add("decode" if len(ctx) > len(prompts[rid]) else "prefill")
    assert kinds == {"decode", "prefill"}
    assert len(rows) > len(prompts) * STEPS  # chunked prefills add rows
    return worst


PROMPTS = {f"a{i}": p for i, p in enumerate(WAVE1)} | {f"b{i}": p for i, p in enumerate(WAVE2)}


SOFTCAP = 5.0  # small enough that tanh bends the scores


@pytest.mark.parametrize("softcap", [0.0, SOFTCAP])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_tiny_gemma3_matches_transformers(gemma_tiny, backend, softcap):
    path, ref = gemma_tiny
    assert check(ref, PROMPTS, run_engine(path, backend, softcap=softcap), softcap) < 1e-4


def test_tiny_gemma3_triton_interpreted_matches_transformers(gemma_tiny, tmp_path):
    """The capped run only (the interpreter is slow): it takes the kernels' window and
    soft-capping branches through extend, chunked extend on a cached prefix, and decode."""
    path, ref = gemma_tiny
    out = tmp_path / "result.pt"
    code = ("import sys, torch; sys.path.insert(0, 'tests/scheduler'); from test_gemma3 import run_engine; "
            f"torch.save(run_engine(__import__('pathlib').Path({str(path)!r}), 'triton', softcap={SOFTCAP}), "
            f"{str(out)!r})")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert check(ref, PROMPTS, torch.load(out), SOFTCAP) < 1e-4


def test_window_matters(gemma_tiny):
    """The sliding layers carry the config's window, and the same run with a wider window
    departs from transformers: the prompts are long enough for the window to matter."""
    path, ref = gemma_tiny
    model = load_model(path, torch.float32, attention_backend="torch")
    assert [layer.self_attn.window for layer in model.layers] == [WINDOW, 0, WINDOW]
    assert model.config.norm_style == "offset" and model.config.final_logit_softcapping == 15.0
    outputs, cached, rows = run_engine(path, "cpu", window=2 * WINDOW)
    rid, ctx, logits = next(r for r in rows if r[0] == "a0" and len(r[1]) == len(WAVE1[0]))
    with torch.no_grad():
        expected = ref(torch.tensor([ctx])).logits[0, -1]
    assert (expected - logits).abs().max().item() > 1e-2


def test_config_variants_and_refusals():
    base = tiny_config().to_dict()
    old_style = {k: v for k, v in base.items() if k not in ("layer_types", "rope_parameters")}
    old_style |= {"sliding_window_pattern": 2, "rope_theta": 5e5, "rope_local_base_freq": 1e4,
                  "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    cfg = ModelConfig.from_hf(old_style)
    assert [layer.sliding_window for layer in cfg.layers] == [WINDOW, 0, WINDOW]
    local, full, _ = (layer.rope for layer in cfg.layers)
    assert (full.theta, full.scaling["factor"], local.theta, local.scaling) == (5e5, 4.0, 1e4, {"rope_theta": 1e4})
    for bad, match in ((dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
                       (dict(hidden_activation="silu"), "hidden_activation 'silu'"),
                       (dict(attention_bias=True), "attention_bias"),
                       (dict(layer_types=["chunked_attention"] * 3), "layer_types"),
                       (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1.0}}), "yarn")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf(base | bad)
