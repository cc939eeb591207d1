"""The tokenizer's side of embeddings (services/tokenizer/embed.py) with a recording dispatcher:
what is sent to the scheduler, the errors named before dispatch, the vectors gathered from the
final rows in input order, a cancel that aborts the inputs still running, and the model
facts that decide pooling and ``dimensions`` (ringserve/modelfacts.py)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from ringserve.modelfacts import embedding_facts
from ringserve.prompt_bounds import CONTEXT_LENGTH_EXCEEDED
from ringserve.v1 import common_pb2, detokenizer_pb2, tokenizer_pb2
from services.tokenizer.embed import MAX_EMBED_INPUTS, Embedder
from services.tokenizer.errors import RequestError

LENGTH = common_pb2.FinishReason(type=common_pb2.FINISH_LENGTH)
ABORT = common_pb2.FinishReason(type=common_pb2.FINISH_ABORT, status="CANCELLED", message="aborted")


def request(*inputs, rid: str = "e", dimensions: int = 0) -> tokenizer_pb2.EmbedRequest:
    req = tokenizer_pb2.EmbedRequest(rid=rid, dimensions=dimensions)
    for item in inputs:
        if isinstance(item, str):
            req.inputs.add(text=item)
        else:
            req.inputs.add().input_ids.ids.extend(item)
    return req


def final_rows(*rows: tuple[str, list[float] | None, common_pb2.FinishReason]) -> detokenizer_pb2.BatchStrOutput:
    out = detokenizer_pb2.BatchStrOutput()
    for i, (rid, values, finish) in enumerate(rows):
        out.rids.append(rid)
        out.texts.append("")
        out.new_token_counts.append(0)
        out.finish_reasons.append(finish)
        out.prompt_tokens.append(0)
        out.completion_tokens.append(0)
        out.cached_tokens.append(0)
        if values is not None:
            out.embeddings.add(row=i, values=values)
    return out


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_inputs_become_prefill_only_requests_and_vectors_come_back_in_order(manager, dispatcher,
                                                                                 smollm2_tokenizer):
    embedder = Embedder(manager)
    task = asyncio.ensure_future(embedder.embed(request("Hello there", [5, 6, 7])))
    await settle()
    sent = dispatcher.reqs
    assert [r.rid for r in sent] == ["e-0", "e-1"]
    assert list(sent[0].input_ids) == smollm2_tokenizer.encode("Hello there") and list(sent[1].input_ids) == [5, 6, 7]
    assert all(r.embed and r.sampling_params.max_new_tokens == 0 and r.tokenizer_id == "tok-test" for r in sent)
    manager.handle_batch(final_rows(("e-1", [0.5, 0.25], LENGTH)))
    manager.handle_batch(final_rows(("e-0", [1.0, -1.0], LENGTH)))
    out = await asyncio.wait_for(task, 5)
    assert [list(e.values) for e in out.embeddings] == [[1.0, -1.0], [0.5, 0.25]]
    assert [e.prompt_tokens for e in out.embeddings] == [len(sent[0].input_ids), 3]
    assert out.prompt_tokens == len(sent[0].input_ids) + 3
    assert manager.load().req_states == 0


@pytest.mark.parametrize("req,message,code", [
    (request(), "input must not be empty", "invalid_value"),
    (request("a", ""), "input[1] is an empty string", "invalid_value"),
    (request([]), "input is empty (0 tokens)", "invalid_value"),
    (request([1, 49152]), "input: token id 49152 is outside the vocabulary [0, 49152)", "invalid_value"),
    (request([1] * 8193), "This model's maximum context length is 8192 tokens. However, input has 8193 tokens. "
                          "Please reduce the length of the input.", CONTEXT_LENGTH_EXCEEDED),
    (request(*["a"] * (MAX_EMBED_INPUTS + 1)), f"input holds {MAX_EMBED_INPUTS + 1} inputs; at most "
                                               f"{MAX_EMBED_INPUTS} are allowed", "invalid_value"),
])
async def test_bad_input_is_refused_naming_it_before_dispatch(manager, dispatcher, req, message, code):
    with pytest.raises(RequestError) as info:
        await Embedder(manager).embed(req)
    err = info.value
    assert (err.status, err.message, err.code, err.param) == (grpc.StatusCode.INVALID_ARGUMENT, message, code, "input")
    assert dispatcher.reqs == [] and manager.load().req_states == 0


async def test_dimensions_are_refused_unless_the_model_declares_them(manager, dispatcher, tmp_path, smollm2_dir):
    with pytest.raises(RequestError) as info:
        await Embedder(manager).embed(request("a", dimensions=64))
    assert info.value.param == "dimensions"
    assert info.value.message == ("dimensions is not supported by this model: its config.json declares no Matryoshka "
                                  "dimensions (is_matryoshka / matryoshka_dimensions); it embeds in 576")
    config = json.loads((smollm2_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [64, 128]}))
    embedder = Embedder(manager, embedding_facts(tmp_path))
    with pytest.raises(RequestError) as info:
        await embedder.embed(request("a", dimensions=100))
    assert (info.value.param, info.value.message) == ("dimensions", "dimensions must be one of [64, 128], got 100")
    task = asyncio.ensure_future(embedder.embed(request("a", dimensions=64)))
    await settle()
    assert dispatcher.reqs[-1].embed_dimensions == 64
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_cancel_aborts_the_inputs_still_running(manager, dispatcher):
    task = asyncio.ensure_future(Embedder(manager).embed(request("a", "b", "c", rid="c")))
    await settle()
    manager.handle_batch(final_rows(("c-1", [1.0], LENGTH)))
    await settle()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert sorted(a.rid for a in dispatcher.aborts) == ["c-0", "c-2"]
    assert manager.load().req_states == 2  # until their abort rows arrive
    manager.handle_batch(final_rows(("c-0", None, ABORT), ("c-2", None, ABORT)))
    assert manager.load().req_states == 0


async def test_an_input_refused_by_the_scheduler_ends_the_call_with_its_status(manager, dispatcher):
    task = asyncio.ensure_future(Embedder(manager).embed(request("a", "b", rid="s")))
    await settle()
    bad = common_pb2.FinishReason(type=common_pb2.FINISH_ABORT, status="INVALID_ARGUMENT", message="cannot pool")
    manager.handle_batch(final_rows(("s-0", None, bad)))
    with pytest.raises(RequestError) as info:
        await asyncio.wait_for(task, 5)
    assert (info.value.status, info.value.message, info.value.param) == (
        grpc.StatusCode.INVALID_ARGUMENT, "cannot pool", "input")
    assert [a.rid for a in dispatcher.aborts] == ["s-0", "s-1"]  # an error row is aborted at the scheduler too


def test_sentence_transformers_files_set_pooling_and_normalisation(tmp_path, smollm2_dir):
    assert embedding_facts(smollm2_dir).resolve(None, None) == ("last", True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    pool = {"word_embedding_dimension": 8, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
            "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    facts = embedding_facts(tmp_path)
    assert (facts.pooling, facts.normalize, facts.refusal) == ("mean", False, None)
    assert facts.resolve(None, None) == ("mean", False) and facts.resolve("cls", True) == ("cls", True)
    # Qwen3-Embedding's layout: last-token pooling, then a Normalize module.
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {**pool, "pooling_mode_mean_tokens": False, "pooling_mode_lasttoken": True}))
    assert embedding_facts(tmp_path).resolve(None, None) == ("last", True)
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert embedding_facts(tmp_path).refusal == "its sentence-transformers modules ['Dense'] (after the pooling) " \
                                                "are not served"
