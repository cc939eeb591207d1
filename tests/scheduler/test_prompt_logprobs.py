"""Prompt logprobs computed during prefill equal transformers' log-softmax of the
same positions (fp32, 1e-4) on 5 prompts: in one extend, in chunks, and after a cached
prefix (the range asked for bypasses the cache); the sum over a continuation is lm-eval's
loglikelihood."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.scheduler.policy.req import FinishType, ReqInput, SamplingParams
from tests.helpers.engine_steps import collect

PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Counting upward by ones, separated by spaces: 1 2 3 4 5 6 7 8 9 10 11 12",
    "社区非常活跃，鼠标与键盘 — café naïve 👍🏽 and a longer tail of ordinary English words to fill it up.",
    "Rivers carve valleys.\n\nThey carry silt from the mountains to the sea, and the delta grows every spring.",
]
TOP = 3


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(reference, tokenizer):
    """Per prompt: (ids, logprob of token p given ids[:p] for p >= 1, top-3 ids and values)."""
    out = []
    for text in PROMPTS:
        ids = tokenizer.encode(text).ids
        with torch.no_grad():
            logp = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)  # [T, V]
        chosen = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        top_vals, top_ids = logp[:-1].topk(TOP, dim=-1)
        out.append((ids, chosen, top_ids, top_vals))
    return out


def scoring(rid: str, ids: list[int], start: int, max_new_tokens: int = 1) -> ReqInput:
    return ReqInput(rid=rid, input_ids=ids, sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
                    logprob_start_len=start, prompt_top_logprobs_num=TOP)


def check(res, ids, chosen, top_ids, top_vals, start: int) -> None:
    first = max(1, start)
    assert res.prompt_start == first
    assert len(res.prompt_logprobs) == len(ids) - first
    torch.testing.assert_close(torch.tensor(res.prompt_logprobs), chosen[first - 1:], atol=1e-4, rtol=0)
    got_vals = torch.tensor(res.prompt_top_vals).view(-1, TOP)
    torch.testing.assert_close(got_vals, top_vals[first - 1:], atol=1e-4, rtol=0)
    got_ids = torch.tensor(res.prompt_top_ids).view(-1, TOP)
    # Ids agree wherever the values are not a near tie.
    ties = (top_vals[first - 1:, :-1] - top_vals[first - 1:, 1:]).abs() < 1e-4
    assert ((got_ids == top_ids[first - 1:])[:, :-1] | ties).all()


@pytest.mark.parametrize("chunk", [0, 7])
def test_prompt_logprobs_match_transformers(make_engine, run_all, expected, chunk):
    engine = make_engine(chunked_prefill_size=chunk, disable_radix_cache=True)
    for k, (ids, *_rest) in enumerate(expected):
        engine.add_request(scoring(f"p{k}", ids, 0))
    results = run_all(engine)
    for k, (ids, chosen, top_ids, top_vals) in enumerate(expected):
        res = results[f"p{k}"]
        check(res, ids, chosen, top_ids, top_vals, 0)
        assert res.completion_tokens == 1 and res.prompt_tokens == len(ids)
    assert engine.load().kv_used_tokens == 0


@pytest.mark.parametrize("chunk", [0, 5])
def test_cached_prefix_is_recomputed_for_the_range_asked(make_engine, run_all, expected, greedy_req, chunk):
    engine = make_engine(chunked_prefill_size=chunk)
    for k, (ids, *_rest) in enumerate(expected):
        engine.add_request(greedy_req(f"warm{k}", ids, 1))
    run_all(engine)  # every prompt is now in the prefix cache
    for k, (ids, *_rest) in enumerate(expected):
        engine.add_request(scoring(f"all{k}", ids, 0))
        engine.add_request(scoring(f"tail{k}", ids, len(ids) // 2))
        engine.add_request(greedy_req(f"plain{k}", ids, 1))
    results = run_all(engine)
    for k, (ids, chosen, top_ids, top_vals) in enumerate(expected):
        check(results[f"all{k}"], ids, chosen, top_ids, top_vals, 0)
        check(results[f"tail{k}"], ids, chosen, top_ids, top_vals, len(ids) // 2)
        assert results[f"all{k}"].cached_tokens == 0  # position 0's logits score token 1
        assert results[f"tail{k}"].cached_tokens == len(ids) // 2 - 1  # the cache up to the range
        assert results[f"plain{k}"].cached_tokens == len(ids) - 1
        assert results[f"plain{k}"].prompt_start is None and not results[f"plain{k}"].prompt_logprobs
    assert engine.load().kv_used_tokens == 0


def test_continuation_sum_is_lm_eval_loglikelihood(make_engine, run_all, reference, tokenizer):
    """lm-eval's loglikelihood(context, continuation): the sum of log-softmax over the
    continuation's tokens given everything before each (and whether each is the argmax)."""
    pairs = [("The capital of France is", " Paris"), ("2 + 2 =", " 4"), ("Roses are red, violets are", " blue.")]
    engine = make_engine(chunked_prefill_size=4)
    lens = []
    for k, (ctx, cont) in enumerate(pairs):
        ctx_ids, cont_ids = tokenizer.encode(ctx).ids, tokenizer.encode(cont).ids
        lens.append((ctx_ids, cont_ids))
        engine.add_request(scoring(f"ll{k}", ctx_ids + cont_ids, len(ctx_ids)))
    results = run_all(engine)
    for k, (ctx_ids, cont_ids) in enumerate(lens):
        ids = ctx_ids + cont_ids
        with torch.no_grad():
            logp = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)
        rows = logp[len(ctx_ids) - 1 : -1]
        want = rows.gather(1, torch.tensor(cont_ids)[:, None]).sum().item()
        greedy = bool((rows.argmax(-1) == torch.tensor(cont_ids)).all())
        res = results[f"ll{k}"]
        assert len(res.prompt_logprobs) == len(cont_ids)
        assert sum(res.prompt_logprobs) == pytest.approx(want, abs=1e-4)
        got_top = torch.tensor(res.prompt_top_ids).view(-1, TOP)[:, 0]
        assert bool((got_top == torch.tensor(cont_ids)).all()) == greedy


def test_retraction_mid_prompt_sends_each_logprob_once(make_engine, run_all, expected, greedy_req):
    """A running decode fills a KV pool too small for it and a chunk-prefilling scoring
    request: the latter is retracted mid-prompt (its chunks go to the prefix cache) and its
    re-prefill resumes at the first position not scored yet: each logprob is sent once."""
    ids, chosen, top_ids, top_vals = expected[4]
    first = expected[0][0]
    engine = make_engine(max_total_tokens=len(first) + len(ids) + 3, chunked_prefill_size=4)
    engine.add_request(greedy_req("decode", first, 20, ignore_eos=True))
    results = {}
    while "decode" not in results:  # its prompt prefilled, it decodes from now on
        if (out := engine.step()) is not None:
            collect(out, results)
    engine.add_request(scoring("score", ids, 0))
    run_all(engine, results)
    assert engine.policy.num_retracted >= 1
    check(results["score"], ids, chosen, top_ids, top_vals, 0)
    assert results["decode"].completion_tokens == 20
    assert engine.load().kv_used_tokens == 0


def test_max_new_tokens_0_scores_only_beside_generating_requests(make_engine, run_all, expected, greedy_req):
    """Scoring requests (max_new_tokens 0) end after their prefill with no token; greedy
    requests in the same steps generate exactly what they generate alone."""
    alone = make_engine(disable_radix_cache=True)
    alone.add_request(greedy_req("g", expected[1][0], 6))
    want = run_all(alone)["g"].output_ids
    engine = make_engine(chunked_prefill_size=16, disable_radix_cache=True)
    for k, (ids, *_rest) in enumerate(expected):
        engine.add_request(scoring(f"s{k}", ids, 0, max_new_tokens=0))
        if k == 1:
            engine.add_request(greedy_req("g", ids, 6))
    results = run_all(engine)
    assert results["g"].output_ids == want
    for k, (ids, chosen, top_ids, top_vals) in enumerate(expected):
        res = results[f"s{k}"]
        check(res, ids, chosen, top_ids, top_vals, 0)
        assert (res.output_ids, res.completion_tokens, res.rows) == ([], 0, 1)
        assert res.finish.type == FinishType.LENGTH
    assert engine.load().kv_used_tokens == 0 and not engine.reqs
