"""The scheduler's Prometheus families against the real engine: exact token, prefix-cache
and finish counts through chunked prefill, retraction, a cached prefix and an abort."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ringserve.metrics import ServiceMetrics
from services.scheduler.metrics import SchedulerMetrics

WORDS = ["ten", "twenty", "thirty", "forty"]


def scrape(metrics: ServiceMetrics) -> dict[str, float]:
    """Sample name (with a finished_reason suffix where labelled) -> value, model_name checked."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            if not s.name.startswith("ringserve:"):
                continue
            assert s.labels["model_name"] == "smol"
            key = s.name + (f"{{{s.labels['finished_reason']}}}" if "finished_reason" in s.labels else "")
            if "le" not in s.labels:
                out[key] = s.value
    return out


def observed(make_engine, **cfg):
    engine = make_engine(**cfg)
    metrics = ServiceMetrics("smol")
    SchedulerMetrics(engine, metrics)
    return engine, metrics


def test_counts_through_chunked_prefill_retraction_and_abort(make_engine, chat_ids, greedy_req, run_all):
    prompts = {f"r{i}": chat_ids(f"Count to {w}.") for i, w in enumerate(WORDS)}
    # All four prompts fit at admission, not all four finished sequences: retraction, and
    # a chunk of 8 tokens prefills each prompt over several steps.
    size = sum(len(p) for p in prompts.values()) + 16
    engine, metrics = observed(make_engine, max_total_tokens=size, disable_radix_cache=True, chunked_prefill_size=8)
    for rid, ids in prompts.items():
        engine.add_request(greedy_req(rid, ids, 16, ignore_eos=True))
    engine.add_request(greedy_req("gone", chat_ids("Never mind."), 16))
    engine.abort(rid="gone")
    got = run_all(engine)
    assert engine.policy.num_retracted > 0
    m = scrape(metrics)

    prompt_total = sum(len(p) for p in prompts.values())
    assert m["ringserve:scheduler_prompt_tokens_total"] == prompt_total  # once per request, retraction or not
    assert m["ringserve:scheduler_generation_tokens_total"] == sum(r.completion_tokens for r in got.values()) == 64
    assert m["ringserve:prefix_cache_queries_total"] == prompt_total
    assert m["ringserve:prefix_cache_hits_total"] == 0  # no radix cache
    assert m["ringserve:num_retractions_total"] == engine.policy.num_retracted
    assert m["ringserve:scheduler_requests_finished_total{length}"] == 4
    assert m["ringserve:scheduler_requests_finished_total{abort}"] == 1
    assert m["ringserve:scheduler_requests_finished_total{stop}"] == 0
    # The aborted request was never scheduled: no queue, prefill or decode time.
    for stage in ("queue", "prefill", "decode"):
        assert m[f"ringserve:request_{stage}_time_seconds_count"] == 4
        assert m[f"ringserve:request_{stage}_time_seconds_sum"] > 0
    assert m["ringserve:num_decode_steps_total"] == engine.num_decode_steps > 0
    # Idle: gauges back to zero, the pool's size as configured.
    assert m["ringserve:num_requests_running"] == m["ringserve:num_requests_waiting"] == 0
    assert m["ringserve:num_prompt_tokens_waiting"] == engine.load().num_waiting_prompt_tokens == 0  # after requeues
    assert m["ringserve:req_slots_used"] == m["ringserve:kv_used_tokens"] == m["ringserve:kv_cache_usage_perc"] == 0
    assert m["ringserve:kv_total_tokens"] == size
    assert m["ringserve:req_slots_total"] == 32
    # The memory split: SmolLM2's fp32 weights (tied embeddings once: one storage), its fp32
    # rotary tables, and the pool's bytes.
    assert m["ringserve:memory_weights_bytes"] == 4 * 134_515_008 + 2 * 4 * 8192 * 64
    assert m["ringserve:memory_kv_cache_bytes"] == size * 46080 and m["ringserve:memory_reserve_bytes"] == 0
    assert not metrics_pending(engine)


def metrics_pending(engine) -> int:
    """Requests the metrics still keep timestamps for (none once idle)."""
    return len(engine.observer._times)


def test_prefix_cache_hits_equal_cached_tokens_and_gauges_follow_occupancy(make_engine, chat_ids, greedy_req, run_all):
    engine, metrics = observed(make_engine)
    ids = chat_ids("What is the capital of France?")
    engine.add_request(greedy_req("a", ids, 4))
    first = run_all(engine)["a"]
    engine.add_request(greedy_req("b", ids, 4))
    second = run_all(engine)["b"]
    assert first.cached_tokens == 0 and second.cached_tokens == len(ids) - 1
    m = scrape(metrics)
    assert m["ringserve:prefix_cache_queries_total"] == 2 * len(ids)
    assert m["ringserve:prefix_cache_hits_total"] == second.cached_tokens
    assert m["ringserve:kv_cached_tokens"] == engine.load().kv_cached_tokens > 0

    # One request waiting behind a running one (one request slot): the gauges read it live.
    engine, metrics = observed(make_engine, max_running_requests=1)
    engine.add_request(greedy_req("run", ids, 8))
    engine.add_request(greedy_req("wait", ids, 8))
    engine.add_request(greedy_req("gone", ids[:5], 8))
    assert engine.load().num_waiting_prompt_tokens == 2 * len(ids) + 5
    engine.abort(rid="gone")
    engine.step()
    m = scrape(metrics)
    assert (m["ringserve:num_requests_running"], m["ringserve:num_requests_waiting"]) == (1, 1)
    assert m["ringserve:num_prompt_tokens_waiting"] == engine.load().num_waiting_prompt_tokens == len(ids)
    assert m["ringserve:req_slots_used"] == 1
    assert m["ringserve:kv_used_tokens"] == len(ids)  # the prompt; its first output token gets a row next step
    assert m["ringserve:kv_cache_usage_perc"] == len(ids) / engine.kv_pool.size
    run_all(engine)


def test_grammar_compiles_are_counted_and_the_compiling_gauge_returns_to_zero(make_engine, chat_ids, run_all):
    from services.scheduler.policy.grammar_backends import GrammarSpec
    from services.scheduler.policy.req import ReqInput, SamplingParams

    engine, metrics = observed(make_engine)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    for rid, regex in (("a", "(yes|no)"), ("b", "(yes|no)"), ("c", "[0-9]{2}")):
        engine.add_request(ReqInput(rid=rid, input_ids=chat_ids("Yes?"), sampling=params,
                                    grammar=GrammarSpec("regex", regex, "regex")))
    assert scrape(metrics)["ringserve:num_requests_compiling"] == 3
    assert scrape(metrics)["ringserve:num_requests_waiting"] == 3
    run_all(engine)
    m = scrape(metrics)
    assert m["ringserve:grammar_compile_time_seconds_count"] == 2  # "a" and "b" share one compile
    assert m["ringserve:num_requests_compiling"] == 0
    assert m["ringserve:scheduler_requests_finished_total{stop}"] == 3
