"""Overlap scheduling on CPU: the engine plans and launches step N+1 before it processes step
N's sampled ids, and gives exactly what it gives without overlap -- per request the same
tokens, finish reasons and matched stops, and the same final gauges -- through EOS and
stop-string stops, length limits, a penalized request (which makes the engine wait for each
step's results), a request that arrives mid-run, aborts that land while the next step is
already launched, and retraction under a small KV pool."""

from __future__ import annotations

import pytest

from services.scheduler.policy.req import FinishType, ReqInput, SamplingParams


def _run(make_engine, chat_ids, overlap: bool, pool: int):
    engine = make_engine(overlap_schedule=overlap, max_total_tokens=pool)
    forward, overlapped = engine.runner.forward, []

    def record(plan, future=None):
        overlapped.append(future is not None)
        return forward(plan, future) if future is not None else forward(plan)

    engine.runner.forward = record
    greedy = lambda **kw: SamplingParams(temperature=0.0, **kw)  # noqa: E731
    engine.add_request(ReqInput(rid="eos", input_ids=chat_ids("What is 2+2?"), sampling=greedy(max_new_tokens=40)))
    engine.add_request(ReqInput(rid="stop", input_ids=chat_ids("Name three colours."),
                                sampling=greedy(max_new_tokens=40, stop=("e",))))
    engine.add_request(ReqInput(rid="len", input_ids=chat_ids("Tell me a story."), return_logprob=True,
                                top_logprobs_num=2, sampling=greedy(max_new_tokens=23, ignore_eos=True)))
    engine.add_request(ReqInput(rid="abort", input_ids=chat_ids("Count to fifty."),
                                sampling=greedy(max_new_tokens=40, ignore_eos=True)))
    engine.add_request(ReqInput(rid="seeded", input_ids=chat_ids("Invent a word."),
                                sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_new_tokens=17,
                                                        ignore_eos=True)))
    results: dict[str, list] = {}
    step = 0
    while engine.has_work:
        out = engine.step()
        step += 1
        if step == 12:
            engine.add_request(ReqInput(rid="late", input_ids=chat_ids("Hi!"),
                                        sampling=greedy(max_new_tokens=9, ignore_eos=True, frequency_penalty=0.5)))
        if out is None:
            continue
        pos = lp = 0
        for i, rid in enumerate(out.rids):
            r = results.setdefault(rid, {"ids": [], "lp": []})
            n, k = out.new_token_counts[i], out.logprob_counts[i]
            r["ids"].extend(out.output_ids[pos : pos + n] if n else [None])
            r["lp"].extend(out.output_token_logprobs[lp : lp + k])
            pos, lp = pos + n, lp + k
            r["finish"] = out.finish_reasons[i]
            r["cached"] = out.cached_tokens[i]
        r = results.get("abort")
        if r is not None and len(r["ids"]) == 15 and "aborted" not in r:
            r["aborted"] = True
            engine.abort("abort")  # with overlap, the step computing its 16th token is in flight
    load = engine.load()
    gauges = (load.req_slots_used, load.kv_used_tokens, load.kv_cached_tokens, load.num_running_reqs,
              engine.kv_pool.available, engine.policy.num_retracted, load.num_finished_reqs, load.num_aborted_reqs)
    return results, gauges, overlapped


@pytest.mark.parametrize("pool", [16384, 64])
def test_overlap_gives_the_same_results_and_gauges(make_engine, chat_ids, pool):
    plain, plain_gauges, plain_overlapped = _run(make_engine, chat_ids, False, pool)
    over, over_gauges, overlapped = _run(make_engine, chat_ids, True, pool)
    assert not any(plain_overlapped) and sum(overlapped) >= (10 if pool > 1000 else 2)  # steps really overlapped
    for rid in plain:
        assert over[rid]["ids"] == plain[rid]["ids"], rid
        assert {k: v for k, v in over[rid].items() if k != "lp"} == {k: v for k, v in plain[rid].items() if k != "lp"}
        # Logprobs to 1e-5, not to the bit: a step planned before a stop was known holds the
        # stopped request's row, and the BLAS blocks a GEMM by its row count (4.4e-6 seen).
        assert over[rid]["lp"] == pytest.approx(plain[rid]["lp"], abs=1e-5), rid
    assert over_gauges == plain_gauges
    assert plain["stop"]["finish"].type == FinishType.STOP and plain["stop"]["finish"].matched_str == "e"
    assert plain["eos"]["finish"].type == FinishType.STOP and plain["eos"]["finish"].matched_token_id is not None
    assert plain["len"]["finish"].type == FinishType.LENGTH and len(plain["len"]["ids"]) == 23
    assert plain["abort"]["finish"].type == FinishType.ABORT and plain["abort"]["ids"][:15] == over["abort"]["ids"][:15]
    assert len(plain["abort"]["ids"]) == 16  # 15 tokens, then the abort row
    assert plain["late"]["finish"].type == FinishType.LENGTH and len(plain["late"]["ids"]) == 9
    assert plain_gauges[:2] == (0, 0) and plain_gauges[3] == 0
    if pool == 64:
        assert plain_gauges[5] > 0  # the small pool retracted
