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
        cfg = replace(base.cfg, max_running_requests=32, max_total_tokens=4096, **overrides)
        engine = Engine(model, tokenizer, base.stops.eos_ids, cfg)
        assert engine.deterministic
        return engine

    return make


STOPS = (" five", ",")
CHUNK = 32  # the prefill step's token budget: the two long prompts chunk
TOPICS = ("rain", "a fox", "the moon", "coffee", "trains", "a garden", "winter", "a river", "bees", "clocks",
          "snow", "a violin", "tides", "maps", "owls", "bridges", "salt", "kites", "a desert", "lanterns", "glass",
          "a harbour", "tea", "thunder", "a forest", "copper", "sails", "a market", "wool", "a canyon", "ink",
          "a bell", "moss", "a kettle")


def _requests(chat_ids, raw_ids) -> list[ReqInput]:
    """45 requests sent at once: two long prompts (chunked at ``CHUNK``), prompt logprobs, stop
    strings, one-token answers, two n=2 seeded pairs, and short greedy ones with logprobs and top
    logprobs (most of them). All but the long ones are plain text of a few tokens, and every one
    asks for a few tokens: the test's cost is the tokens its three engines compute. Rows ask for
    1, 3 or 5 top logprobs: tied ones (bf16 logits) come in the same order whatever the largest
    ask of the batch a row is in."""
    reqs = []
    for k, text in enumerate(("Tell me about lighthouses, the sea, the wind and the ships " * 2,
                              "List the planets, their moons, their rings and their colours " * 2)):
        reqs.append(ReqInput(rid=f"long-{k}", input_ids=chat_ids(text), return_logprob=True, top_logprobs_num=3,
                             sampling=SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)))
    for k, text in enumerate(("The colour of grass is", "A fruit that is red:")):
        reqs.append(ReqInput(rid=f"prompt-lp-{k}", input_ids=raw_ids(text), logprob_start_len=1,
                             prompt_top_logprobs_num=2, return_logprob=True,
                             sampling=SamplingParams(temperature=0.0, max_new_tokens=3)))
    for k, stop in enumerate(STOPS):
        reqs.append(ReqInput(rid=f"stop-{k}", input_ids=raw_ids("Counting: one, two, three,"),
                             sampling=SamplingParams(temperature=0.0, max_new_tokens=8, stop=(stop,))))
    for k in range(2):
        reqs.append(ReqInput(rid=f"one-{k}", input_ids=raw_ids(f"Hello, {TOPICS[k]}"),
                             sampling=SamplingParams(temperature=0.0, max_new_tokens=1)))
    # n=2: two seeded samples of one prompt (their generators' states cross with the first token).
    for j, text in enumerate(("A line about bread:", "A line about stone:")):
        for k in range(2):
            reqs.append(ReqInput(rid=f"n2-{j}-{k}", input_ids=raw_ids(text), return_logprob=True,
                                 sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=7 + k, max_new_tokens=4,
                                                         ignore_eos=True)))
    for k, topic in enumerate(TOPICS[:33]):
        reqs.append(ReqInput(rid=f"short-{k}", input_ids=raw_ids(f"A word for {topic}:"), return_logprob=k % 4 != 3,
                             top_logprobs_num=(0, 1, 0, 3, 0, 5)[k % 6],
                             sampling=SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)))
    return reqs


def _again(reqs: list[ReqInput]) -> list[ReqInput]:
    """5 requests that repeat earlier prompts: prefix-cache hits on the prefill side."""
    return [replace(spec, rid=f"{spec.rid}-again") for spec in reqs if spec.rid in (
        "long-0", "long-1", "n2-0-0", "short-0", "short-1")]


def _same(got: dict[str, Result], want: dict[str, Result], reqs: list[ReqInput], suffix: str = "") -> None:
    """Tokens, logprobs, top logprobs, prompt logprobs and finish of each request equal, bit for bit."""
    for spec in reqs:
        g, w = got[spec.rid], want[spec.rid.removesuffix(suffix)]
        assert (g.output_ids, g.logprobs, g.top_ids, g.top_vals) == (w.output_ids, w.logprobs, w.top_ids, w.top_vals)
        assert (g.prompt_start, g.prompt_logprobs, g.prompt_top_ids) == (w.prompt_start, w.prompt_logprobs,
                                                                         w.prompt_top_ids)
        assert g.finish == w.finish and g.completion_tokens == w.completion_tokens
        assert g.init_rows == [g.init_rows[0]]  # one RowInit, on the decode side's first row


def test_prefill_here_decode_there_equals_one_engine(det_engine, chat_ids, tokenizer):
    reqs = _requests(chat_ids, lambda text: tokenizer.encode(text).ids)
    again = _again(reqs)
    assert (len(reqs) + len(again), sum(len(r.input_ids) > CHUNK for r in reqs)) == (50, 2)
    colocated = det_engine()  # prompts whole: chunking does not change a bit
    for spec in reqs:
        colocated.add_request(spec)
    want: dict[str, Result] = {}
    while colocated.has_work:
        if (out := colocated.step()) is not None:
            collect(out, want)

    pair = Pair(det_engine(chunked_prefill_size=CHUNK), det_engine())
    for spec in reqs:
        pair.add(spec)
    got = pair.run()
    assert pair.prefill_rows == {}  # the decode side alone talks to the detokenizer
    assert set(got) == {r.rid for r in reqs}
    _same(got, want, reqs)
    assert pair.peak_slots == 32  # 32 in flight on the decode side at once, the rest waiting for a slot
    assert [(got[f"stop-{k}"].finish.type, got[f"stop-{k}"].finish.matched_str) for k in range(len(STOPS))] == [
        (FinishType.STOP, stop) for stop in STOPS]
    assert all(len(got[f"one-{k}"].output_ids) == 1 and got[f"one-{k}"].finish.type == FinishType.LENGTH
               for k in range(2))
    assert got["n2-0-0"].output_ids != got["n2-0-1"].output_ids  # two samples, not one twice
    bytes_per_token = pair.prefill.kv_pool.bytes_per_token()
    assert pair.moved == bytes_per_token * sum(len(r.input_ids) for r in reqs)
    # Each chunk's rows moved once computed, before the first token was sampled; the last chunk's after.
    for spec in reqs:
        ranges = pair.ranges[spec.rid]
        assert [first for first, _ in ranges] == [0] + [end for _, end in ranges[:-1]]
        assert (ranges[-1][1], pair.early.get(spec.rid, 0)) == (len(spec.input_ids), len(ranges) - 1)
    assert {rid: r for rid, r in pair.ranges.items() if len(r) > 1} == {  # the step's budget of 32, chunk by chunk
        "long-0": [(0, 32), (32, 40)], "long-1": [(0, 24), (24, 34)], "stop-1": [(0, 2), (2, 9)],
        "short-0": [(0, 3), (3, 5)], "short-7": [(0, 4), (4, 6)], "short-22": [(0, 4), (4, 5)]}
    # Again on the same pair: the prefill side's prefix cache supplies all but the last prompt token.
    for spec in again:
        pair.add(spec)
    got_again = pair.run()
    assert [got_again[s.rid].cached_tokens for s in again] == [len(s.input_ids) - 1 for s in again]
    _same(got_again, want, again, "-again")
    for engine in (pair.prefill, pair.decode):  # every slot back; rows only the prefix cache holds
        load = engine.load()
        assert (load.req_slots_used, load.kv_used_tokens, load.num_transfer_reqs, len(engine.reqs)) == (0, 0, 0, 0)
