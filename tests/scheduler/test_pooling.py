"""Embedding requests in the engine: their pooled final hidden states equal transformers' last
hidden state pooled the same way (fp32, 1e-4) for last-token, mean and first-token pooling, in
one extend and in chunks, beside generating requests whose output they leave unchanged; the
prefix cache serves last-token pooling only; a retracted mean-pooled prompt pools once; an
abort frees everything; Matryoshka cuts and normalisation; a pipeline that cannot be pooled is
refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModel

from services.scheduler.policy.req import FinishType, ReqInput, SamplingParams
from tests.helpers.engine_steps import collect

PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def add(a, b):\n    return a + b",
    "社区非常活跃 — café naïve 👍🏽",
    "Rivers carve valleys; they carry silt from the mountains to the sea.",
    "a",
]


@pytest.fixture(scope="module")
def hidden(smollm2_dir, tokenizer):
    """Per prompt: (ids, transformers' last hidden state [T, hidden], after the final norm)."""
    model = AutoModel.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    out = []
    for text in PROMPTS:
        ids = tokenizer.encode(text).ids
        with torch.no_grad():
            out.append((ids, model(torch.tensor([ids])).last_hidden_state[0]))
    return out


def pooled(h: torch.Tensor, mode: str, normalize: bool = True, dims: int = 0) -> torch.Tensor:
    v = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[mode]
    v = v[:dims] if dims else v
    return torch.nn.functional.normalize(v, dim=0) if normalize else v


def embed(rid: str, ids: list[int], dims: int = 0) -> ReqInput:
    return ReqInput(rid=rid, input_ids=ids, sampling=SamplingParams(max_new_tokens=0), embed=True,
                    embed_dimensions=dims)


def close(got, want) -> None:
    torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
@pytest.mark.parametrize("chunk", [0, 5])
def test_embeddings_match_transformers_beside_generation(make_engine, run_all, hidden, greedy_req, mode, chunk):
    alone = make_engine(disable_radix_cache=True)
    alone.add_request(greedy_req("g", hidden[0][0], 8))
    want = run_all(alone)["g"].output_ids
    engine = make_engine(chunked_prefill_size=chunk, embedding_pooling=mode)
    for k, (ids, _) in enumerate(hidden):
        engine.add_request(embed(f"e{k}", ids))
        if k == 1:
            engine.add_request(greedy_req("g", hidden[0][0], 8))
    results = run_all(engine)
    assert results["g"].output_ids == want
    for k, (ids, h) in enumerate(hidden):
        res = results[f"e{k}"]
        close(res.embedding, pooled(h, mode))
        assert (res.output_ids, res.completion_tokens, res.prompt_tokens, res.rows) == ([], 0, len(ids), 1)
        assert res.finish.type == FinishType.LENGTH
    load = engine.load()
    assert (load.kv_used_tokens, load.req_slots_used, load.num_running_reqs) == (0, 0, 0) and not engine.reqs


@pytest.mark.parametrize("mode,cached", [("last", True), ("mean", False), ("cls", False)])
def test_only_last_token_pooling_takes_a_cached_prefix(make_engine, run_all, hidden, greedy_req, mode, cached):
    engine = make_engine(chunked_prefill_size=4, embedding_pooling=mode)
    for k, (ids, _) in enumerate(hidden[:4]):
        engine.add_request(greedy_req(f"warm{k}", ids, 1))
    run_all(engine)  # every prompt is now in the prefix cache
    for k, (ids, _) in enumerate(hidden[:4]):
        engine.add_request(embed(f"e{k}", ids))
    results = run_all(engine)
    for k, (ids, h) in enumerate(hidden[:4]):
        close(results[f"e{k}"].embedding, pooled(h, mode))
        assert results[f"e{k}"].cached_tokens == (len(ids) - 1 if cached else 0)


def test_retraction_mid_prompt_pools_the_mean_once(make_engine, run_all, hidden, greedy_req):
    """A decode fills a KV pool too small for it and a chunk-prefilling embedding: the embedding
    is retracted mid-prompt and prefilled again from its start; its mean counts each row once."""
    ids, h = hidden[3]
    first = hidden[0][0]
    engine = make_engine(max_total_tokens=len(first) + len(ids) + 3, chunked_prefill_size=4,
                         embedding_pooling="mean")
    engine.add_request(greedy_req("decode", first, len(ids), ignore_eos=True))
    results: dict = {}
    while "decode" not in results:
        if (out := engine.step()) is not None:
            collect(out, results)
    engine.add_request(embed("e", ids))
    run_all(engine, results)
    assert engine.policy.num_retracted >= 1
    close(results["e"].embedding, pooled(h, "mean"))
    assert results["decode"].completion_tokens == len(ids) and engine.load().kv_used_tokens == 0


def test_dimensions_are_cut_before_normalising(make_engine, run_all, hidden):
    ids, h = hidden[0]
    engine = make_engine(embedding_normalize=False)
    engine.add_request(embed("raw", ids))
    engine.add_request(embed("cut", ids, dims=64))
    normalized = make_engine(embedding_normalize=True)
    normalized.add_request(embed("cut", ids, dims=64))
    raw, cut = run_all(engine), run_all(normalized)
    close(raw["raw"].embedding, pooled(h, "last", normalize=False))
    close(raw["cut"].embedding, pooled(h, "last", normalize=False, dims=64))
    close(cut["cut"].embedding, pooled(h, "last", dims=64))
    assert len(cut["cut"].embedding) == 64 and len(raw["raw"].embedding) == h.shape[1]


def test_abort_of_a_chunk_prefilling_embedding_frees_its_slot(make_engine, hidden, greedy_req, run_all):
    engine = make_engine(chunked_prefill_size=4, disable_radix_cache=True)
    engine.add_request(embed("e", hidden[0][0]))
    engine.add_request(greedy_req("g", hidden[1][0], 4))
    results: dict = {}
    assert engine.step() is None  # e's first chunk: no row yet, a slot and KV held
    assert engine.load().req_slots_used == 1 and engine.load().kv_used_tokens == 4
    assert engine.abort("e") == 1
    run_all(engine, results)
    assert results["e"].finish.type == FinishType.ABORT and results["e"].embedding is None
    assert results["g"].completion_tokens == 4
    load = engine.load()
    assert (load.kv_used_tokens, load.req_slots_used, load.num_running_reqs, load.num_waiting_reqs) == (0, 0, 0, 0)


def test_an_unservable_sentence_transformers_pipeline_is_refused(make_engine, run_all, hidden, tmp_path,
                                                                 smollm2_dir):
    (tmp_path / "config.json").write_text((smollm2_dir / "config.json").read_text())
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    engine = make_engine(model=tmp_path)
    engine.add_request(embed("e", hidden[0][0]))
    res = run_all(engine)["e"]
    assert res.finish.type == FinishType.ABORT and res.finish.status == "INVALID_ARGUMENT"
    assert res.finish.message == ("this model's embeddings cannot be served: its sentence-transformers pooling "
                                  "['pooling_mode_max_tokens'] is not served (one of ['pooling_mode_cls_token', "
                                  "'pooling_mode_lasttoken', 'pooling_mode_mean_tokens'] is) (--embedding-pooling "
                                  "overrides)")
    # The flag overrides the model's pooling; its Normalize-less pipeline means no normalisation.
    flagged = make_engine(model=tmp_path, embedding_pooling="mean")
    flagged.add_request(embed("e", hidden[0][0]))
    close(run_all(flagged)["e"].embedding, pooled(hidden[0][1], "mean", normalize=False))
