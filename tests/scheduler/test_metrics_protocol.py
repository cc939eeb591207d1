"""The model server protocol's metrics (what a Kubernetes endpoint picker scrapes, under
vLLM's names) read from the scheduler's exposition against the engine's state: their types,
labels and values idle, with one request running, with one queued behind it, and the KV
usage a long prompt leaves, each equal to the ringserve: family it aliases."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ringserve.kv_events import PAGE_SIZE
from ringserve.metrics import ServiceMetrics
from services.scheduler.metrics import SchedulerMetrics

PROTOCOL = {  # vLLM name -> the ringserve family it aliases
    "vllm:num_requests_waiting": "ringserve:num_requests_waiting",
    "vllm:num_requests_running": "ringserve:num_requests_running",
    "vllm:kv_cache_usage_perc": "ringserve:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc": "ringserve:kv_cache_usage_perc",
    "vllm:cache_config_info": "ringserve:cache_config_info",
}


def exposition(metrics: ServiceMetrics) -> dict[str, tuple[str, dict[str, str], float]]:
    """Family name -> (type, labels, value) of its one sample, parsed from the text a scrape gets."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        if family.name in PROTOCOL or family.name in PROTOCOL.values():
            (sample,) = family.samples
            assert sample.name == family.name
            out[family.name] = (family.type, sample.labels, sample.value)
    return out


def protocol(metrics: ServiceMetrics) -> dict[str, float]:
    """The protocol's gauges by vLLM name, each checked against its ringserve: family."""
    got = exposition(metrics)
    for name, own in PROTOCOL.items():
        assert got[name] == got[own], name
        assert got[name][0] == "gauge", name
    return {name: got[name][2] for name in PROTOCOL}


def test_cache_config_info_labels_the_pools_geometry(make_engine):
    engine = make_engine(max_total_tokens=1000)
    metrics = ServiceMetrics("smol")
    SchedulerMetrics(engine, metrics)
    kind, labels, value = exposition(metrics)["vllm:cache_config_info"]
    assert (kind, value) == ("gauge", 1.0)
    assert labels == {"model_name": "smol", "block_size": str(PAGE_SIZE), "num_gpu_blocks": str(1000 // PAGE_SIZE)}


def test_running_queued_and_kv_usage_follow_the_engine(make_engine, chat_ids, greedy_req, run_all):
    size = 2048
    engine = make_engine(max_running_requests=1, max_total_tokens=size)
    metrics = ServiceMetrics("smol")
    SchedulerMetrics(engine, metrics)
    idle = {"vllm:num_requests_waiting": 0, "vllm:num_requests_running": 0, "vllm:kv_cache_usage_perc": 0,
            "vllm:gpu_cache_usage_perc": 0, "vllm:cache_config_info": 1}
    assert protocol(metrics) == idle

    # A long prompt (no chunking): after its prefill step it runs, and its rows are held.
    long_ids = chat_ids(" ".join(f"word{i}" for i in range(200)))
    assert len(long_ids) > 400
    engine.add_request(greedy_req("long", long_ids, 8))
    assert protocol(metrics)["vllm:num_requests_waiting"] == 1  # queued before the first step
    engine.step()
    m = protocol(metrics)
    assert (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]) == (1, 0)
    assert m["vllm:kv_cache_usage_perc"] == len(long_ids) / size

    # One request slot: a second request queues behind it.
    short_ids = chat_ids("Hi.")
    engine.add_request(greedy_req("short", short_ids, 4))
    engine.step()
    m = protocol(metrics)
    assert (m["vllm:num_requests_running"], m["vllm:num_requests_waiting"]) == (1, 1)
    assert m["vllm:kv_cache_usage_perc"] == (len(long_ids) + 1) / size  # its first output token got a row

    run_all(engine)
    # Idle again: the finished prompts stay in the prefix cache, which counts as free.
    assert protocol(metrics) == idle
    assert engine.load().kv_cached_tokens > 0
