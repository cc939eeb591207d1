"""Aborts free KV tokens and req slots at once, for running and waiting requests alike."""

from __future__ import annotations

from services.scheduler.policy.req import FinishType, ReqInput, SamplingParams


def test_abort_running_and_waiting_frees_memory(make_engine, chat_ids, greedy_req, run_all):
    engine = make_engine(max_running_requests=1)
    prompt = chat_ids("Write a very long story.")
    base = engine.load()
    engine.add_request(greedy_req("running", prompt, 200, ignore_eos=True))
    engine.add_request(greedy_req("waiting", prompt, 200, ignore_eos=True))
    results = {}
    run_all(engine, results, max_steps=4)  # prefill + 3 decode steps of "running"; one req slot only
    load = engine.load()
    assert (load.num_running_reqs, load.num_waiting_reqs, load.req_slots_used) == (1, 1, 1)
    assert load.kv_used_tokens == len(prompt) + 3  # the newest token's K/V is written next step

    engine.abort(rid="running", message="client went away")
    engine.abort(rid="waiting")
    run_all(engine, results)
    after = engine.load()
    assert (after.num_running_reqs, after.num_waiting_reqs) == (0, 0)
    assert (after.kv_used_tokens, after.req_slots_used) == (base.kv_used_tokens, base.req_slots_used) == (0, 0)
    assert after.num_aborted_reqs == 2
    assert results["running"].finish.type == FinishType.ABORT
    assert results["running"].finish.message == "client went away"
    assert results["running"].completion_tokens == 4
    assert results["waiting"].finish.type == FinishType.ABORT
    assert results["waiting"].output_ids == [] and len(results["waiting"].init_rows) == 1

    # The engine serves the next request exactly as a fresh one would.
    engine.add_request(greedy_req("next", prompt, 12, ignore_eos=True))
    fresh = make_engine()
    fresh.add_request(greedy_req("next", prompt, 12, ignore_eos=True))
    assert run_all(engine)["next"].output_ids == run_all(fresh)["next"].output_ids
    assert engine.load().kv_used_tokens == 0


def test_abort_by_tokenizer_id_spares_other_owners(make_engine, chat_ids, run_all):
    engine = make_engine()
    prompt = chat_ids("Count to twelve.")
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    for i in range(3):
        engine.add_request(ReqInput(rid=f"a{i}", input_ids=prompt, sampling=params, tokenizer_id="tok-a"))
    engine.add_request(ReqInput(rid="b0", input_ids=prompt, sampling=params, tokenizer_id="tok-b"))
    results = run_all(engine, {}, max_steps=3)
    assert engine.abort(tokenizer_id="tok-a", status="UNAVAILABLE") == 3
    assert engine.load().num_running_reqs == 1
    run_all(engine, results)
    assert [results[f"a{i}"].finish.status for i in range(3)] == ["UNAVAILABLE"] * 3
    assert results["b0"].finish.type == FinishType.LENGTH and results["b0"].completion_tokens == 12
    assert (engine.load().kv_used_tokens, engine.load().req_slots_used) == (0, 0)


def test_invalid_and_duplicate_requests_get_abort_rows(make_engine, greedy_req, run_all):
    engine = make_engine(context_length=64)
    engine.add_request(greedy_req("ok", [1, 2, 3], 8, ignore_eos=True))
    engine.add_request(greedy_req("ok", [4, 5, 6], 8))  # duplicate in-flight rid
    engine.add_request(greedy_req("empty", [], 8))
    engine.add_request(greedy_req("oov", [1, 49152], 8))
    engine.add_request(greedy_req("long", list(range(60)), 8))
    dup = engine.step()
    assert dup.rids[:4] == ["ok", "empty", "oov", "long"]
    assert [f.status for f in dup.finish_reasons[:4]] == ["ALREADY_EXISTS"] + ["INVALID_ARGUMENT"] * 3
    assert "exceeds the context length 64" in dup.finish_reasons[3].message
    assert [i.row for i in dup.inits] == [1, 2, 3, 4]  # the duplicate's row leaves the first's RowInit alone
    results = run_all(engine)
    assert results["ok"].completion_tokens == 8 and results["ok"].finish.type == FinishType.LENGTH
