"""Continuous batching: concurrent requests decode together and each equals its solo run."""

from __future__ import annotations

TOPICS = [
    "rivers", "mountains", "the moon", "bread", "trains", "owls", "chess", "rain",
    "copper", "violins", "deserts", "bees", "glass", "tides", "maps", "salt",
]


def test_sixteen_concurrent_requests_equal_solo_runs(make_engine, chat_ids, greedy_req, run_all):
    prompts = {f"c{i}": chat_ids(f"Tell me one fact about {t}.") for i, t in enumerate(TOPICS)}
    # Different lengths make requests finish at different steps, so the batch changes shape.
    max_new = {rid: 6 + (i % 4) * 2 for i, rid in enumerate(prompts)}

    solo = {}
    for rid, ids in prompts.items():
        engine = make_engine()
        engine.add_request(greedy_req(rid, ids, max_new[rid], ignore_eos=True))
        solo[rid] = run_all(engine)[rid].output_ids

    engine = make_engine()
    base = engine.load()
    rids = list(prompts)
    for rid in rids[:8]:
        engine.add_request(greedy_req(rid, prompts[rid], max_new[rid], ignore_eos=True))
    results = {}
    for _ in range(2):  # the first eight are decoding when the next eight arrive
        run_all(engine, results, max_steps=1)
    for rid in rids[8:]:
        engine.add_request(greedy_req(rid, prompts[rid], max_new[rid], ignore_eos=True))
    run_all(engine, results)

    load = engine.load()
    assert load.peak_decode_batch_size == 16
    assert {rid: r.output_ids for rid, r in results.items()} == solo
    assert all(r.completion_tokens == max_new[rid] for rid, r in results.items())
    assert (load.kv_used_tokens, load.req_slots_used, load.num_running_reqs) == (base.kv_used_tokens, 0, 0)
    assert load.num_finished_reqs == 16
