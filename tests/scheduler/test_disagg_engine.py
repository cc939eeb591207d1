"""Prefill/decode disaggregation between two engines in one process: a request prefilled on one
engine and decoded on another gives the tokens and logprobs of one co-located engine, bit for
bit, under deterministic inference; the KV moves through the ``grpc`` transfer engine's pieces
(``pack`` on the prefill side, ``receive`` on the decode side) without the network.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.scheduler.engine.engine import Engine
from services.scheduler.models import load_model
from services.scheduler.policy.req import FinishType, ReqInput, SamplingParams
from tests.helpers.disagg import Pair
from tests.helpers.engine_steps import Result, collect


@pytest.fixture(scope="module")
def det_engine(smollm2_dir, tokenizer, make_engine):
    """Factory of deterministic engines over a bf16 SmolLM2 with the cpu attention backend."""
    model = load_model(smollm2_dir, torch.bfloat16, attention_backend="cpu")
    base = make_engine()

    def make(**overrides) -> Engine:
        cfg = replace(base.cfg, max_running_requests=16, max_total_tokens=4096, **overrides)
        engine = Engine(model, tokenizer, base.stops.eos_ids, cfg)
        assert engine.deterministic
        return engine

    return make


def _requests(chat_ids) -> list[ReqInput]:
    long = chat_ids("Tell me about lighthouses, the sea, the wind and the ships " * 4)  # chunked at 32
    reqs = [
        ReqInput(rid="long", input_ids=long, return_logprob=True, top_logprobs_num=3,
                 sampling=SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)),
        ReqInput(rid="prompt-lp", input_ids=chat_ids("Name a colour."), logprob_start_len=3, prompt_top_logprobs_num=2,
                 return_logprob=True, sampling=SamplingParams(temperature=0.0, max_new_tokens=6)),
        ReqInput(rid="stop", input_ids=chat_ids("Count from one to ten in words."),
                 sampling=SamplingParams(temperature=0.0, max_new_tokens=40, stop=("\n3",))),
        ReqInput(rid="one", input_ids=chat_ids("Say hi."), sampling=SamplingParams(temperature=0.0, max_new_tokens=1)),
    ]
    # n=2: two seeded samples of one prompt (their generators' states cross with the first token).
    for k in range(2):
        reqs.append(ReqInput(rid=f"n2-{k}", input_ids=chat_ids("Write a line about bread."), return_logprob=True,
                             sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=7 + k, max_new_tokens=10,
                                                     ignore_eos=True)))
    return reqs


def test_prefill_here_decode_there_equals_one_engine(det_engine, chat_ids):
    reqs = _requests(chat_ids)
    colocated = det_engine(chunked_prefill_size=32)
    for spec in reqs:
        colocated.add_request(spec)
    want: dict[str, Result] = {}
    while colocated.has_work:
        if (out := colocated.step()) is not None:
            collect(out, want)

    pair = Pair(det_engine(chunked_prefill_size=32), det_engine())
    for spec in reqs:
        pair.add(spec)
    got = pair.run()
    assert pair.prefill_rows == {}  # the decode side alone talks to the detokenizer
    assert set(got) == {r.rid for r in reqs}
    for spec in reqs:
        g, w = got[spec.rid], want[spec.rid]
        assert (g.output_ids, g.logprobs, g.top_ids, g.top_vals) == (w.output_ids, w.logprobs, w.top_ids, w.top_vals)
        assert (g.prompt_start, g.prompt_logprobs, g.prompt_top_ids) == (w.prompt_start, w.prompt_logprobs,
                                                                         w.prompt_top_ids)
        assert g.finish == w.finish and g.completion_tokens == w.completion_tokens
        assert g.init_rows == [g.init_rows[0]]  # one RowInit, on the decode side's first row
    assert got["stop"].finish.type == FinishType.STOP and got["stop"].finish.matched_str == "\n3"
    assert len(got["one"].output_ids) == 1 and got["one"].finish.type == FinishType.LENGTH
    bytes_per_token = pair.prefill.kv_pool.bytes_per_token()
    assert pair.moved == bytes_per_token * sum(len(r.input_ids) for r in reqs)

    # Again on the same pair: the prefill side's prefix cache supplies all but the last prompt token.
    pair.add(replace(reqs[0], rid="long-again"))
    again = pair.run()["long-again"]
    assert again.cached_tokens == len(reqs[0].input_ids) - 1
    assert (again.output_ids, again.logprobs) == (want["long"].output_ids, want["long"].logprobs)
    for engine in (pair.prefill, pair.decode):  # every slot back; rows only the prefix cache holds
        load = engine.load()
        assert (load.req_slots_used, load.kv_used_tokens, load.num_transfer_reqs, len(engine.reqs)) == (0, 0, 0, 0)
