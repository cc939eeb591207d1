"""Every service's Prometheus endpoint on the launched ring: exact counter deltas after known
requests, gauges back to zero when idle, the metric list of docs/metrics.md equal to what the
ring exports, and the Grafana dashboard querying only exported names."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import orjson

from tests.helpers.ring_requests import PROMPT
from tests.helpers.ringstack import SERVICES

REPO = Path(__file__).resolve().parents[2]
METRICS_DOC = REPO / "docs" / "metrics.md"
DASHBOARD = REPO / "deploy" / "grafana" / "ringserve.json"
NAME = re.compile(r"ringserve:[A-Za-z0-9_:]+")


def scrape_all(stack) -> dict[str, dict]:
    return {name: stack.scrape(name) for name in SERVICES}


def delta(stack, before: dict, after: dict, service: str, name: str, **labels) -> float:
    key = (name, tuple(sorted({"model_name": stack.model_name, **labels}.items())))
    return after[service].get(key, 0.0) - before[service].get(key, 0.0)


def value(stack, samples: dict, service: str, name: str) -> float:
    return samples[service][(name, (("model_name", stack.model_name),))]


def scrape_when(stack, settled, timeout_s: float = 10.0) -> dict[str, dict]:
    """Scrape every service until ``settled(samples)`` holds: a call's last observations
    (its send time, the gateway's in-flight count) land just after the client has the
    response. Raises AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not settled(samples := scrape_all(stack)):
        assert time.monotonic() < deadline, "metrics did not settle"
        time.sleep(0.05)
    return samples


def exported_names(stack) -> set[str]:
    """Every ringserve: sample and family name the four services export now."""
    from prometheus_client.parser import text_string_to_metric_families

    names = set()
    for name in SERVICES:
        for family in text_string_to_metric_families(httpx.get(stack.metrics_urls[name], timeout=10).text):
            names.add(family.name)
            names.update(s.name for s in family.samples)
    return {n for n in names if n.startswith("ringserve:")}


def documented_metrics() -> set[str]:
    """The metric names docs/metrics.md lists (first column of its tables)."""
    text = METRICS_DOC.read_text()
    return {m.group(1) for m in re.finditer(r"^\| `(ringserve:[^`]+)`", text, re.MULTILINE)}


def test_known_requests_move_every_service_metric_exactly(stack):
    stack.wait_idle()
    before = scrape_all(stack)
    usages = []
    # The same prompt twice: the second finds all but its last token in the prefix cache.
    for _ in range(2):
        body = {"model": stack.model_name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])
    body = {"model": stack.model_name, "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    chunks = [orjson.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    usages.append(chunks[-1]["usage"])
    stack.wait_idle()

    def settled(now: dict) -> bool:
        return (delta(stack, before, now, "tokenizer", "ringserve:request_send_time_seconds_count") == 3
                and delta(stack, before, now, "tokenizer", "ringserve:request_dispatch_time_seconds_count") == 3
                and value(stack, now, "gateway", "ringserve:gateway_requests_in_flight") == 0)

    after = scrape_when(stack, settled)

    prompt = sum(u["prompt_tokens"] for u in usages)
    completion = sum(u["completion_tokens"] for u in usages)
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert completion == 4 + 4 + 5
    assert cached[1] == usages[1]["prompt_tokens"] - 1 > 0

    def d(service: str, name: str, **labels) -> float:
        return delta(stack, before, after, service, name, **labels)

    # Scheduler: tokens, prefix cache (tokens queried and hit, as vLLM), stages, finishes.
    assert d("scheduler", "ringserve:scheduler_prompt_tokens_total") == prompt
    assert d("scheduler", "ringserve:scheduler_generation_tokens_total") == completion
    assert d("scheduler", "ringserve:prefix_cache_queries_total") == prompt
    assert d("scheduler", "ringserve:prefix_cache_hits_total") == sum(cached)
    assert d("scheduler", "ringserve:scheduler_requests_finished_total", finished_reason="length") == 3
    assert d("scheduler", "ringserve:scheduler_requests_finished_total", finished_reason="abort") == 0
    for stage in ("queue", "prefill", "decode"):
        assert d("scheduler", f"ringserve:request_{stage}_time_seconds_count") == 3
    # One request at a time, each prompt in one step: a step per output token, all but the
    # first of each request decoding; the detokenizer decodes each step once.
    assert d("scheduler", "ringserve:num_decode_steps_total") == completion - 3
    assert d("detokenizer", "ringserve:detokenize_step_time_seconds_count") == completion
    assert d("scheduler", "ringserve:num_retractions_total") == 0
    # Tokenizer: one tokenize, dispatch and send per Generate call (n = 1).
    for stage in ("tokenize", "dispatch", "send"):
        assert d("tokenizer", f"ringserve:request_{stage}_time_seconds_count") == 3
    # The gateway counts the same tokens from the client's side.
    assert d("gateway", "ringserve:prompt_tokens_total") == prompt
    assert d("gateway", "ringserve:generation_tokens_total") == completion

    # Idle: what each service owns is back to zero (the occupancy gauges).
    for service, name in (("tokenizer", "ringserve:req_states"), ("detokenizer", "ringserve:decode_states"),
                          ("scheduler", "ringserve:num_requests_running"),
                          ("scheduler", "ringserve:num_requests_waiting"), ("scheduler", "ringserve:req_slots_used"),
                          ("scheduler", "ringserve:kv_used_tokens"), ("scheduler", "ringserve:kv_cache_usage_perc"),
                          ("gateway", "ringserve:gateway_requests_in_flight")):
        assert value(stack, after, service, name) == 0, (service, name)
    sched = stack.scheduler_load()
    assert value(stack, after, "scheduler", "ringserve:kv_cached_tokens") == sched.kv_cached_tokens > 0
    assert value(stack, after, "scheduler", "ringserve:kv_total_tokens") == sched.kv_total_tokens


def test_gauges_show_a_request_in_flight(stack):
    """While a long streamed request runs, each service's gauge counts it."""
    stack.wait_idle()
    body = {"model": stack.model_name, "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=stack.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            lines = resp.iter_lines()  # held open: a collected line iterator closes the response
            for line in lines:
                if line.startswith("data: {") and '"content"' in line:
                    break
            now = scrape_all(stack)
            lines.close()
    stack.wait_idle()
    assert value(stack, now, "tokenizer", "ringserve:req_states") == 1
    assert value(stack, now, "detokenizer", "ringserve:decode_states") == 1
    assert value(stack, now, "scheduler", "ringserve:num_requests_running") == 1
    assert value(stack, now, "scheduler", "ringserve:req_slots_used") == 1
    assert value(stack, now, "scheduler", "ringserve:kv_used_tokens") > 0
    assert value(stack, now, "gateway", "ringserve:gateway_requests_in_flight") == 1
    # The model server protocol's names (what a Kubernetes endpoint picker reads) say the same.
    aliases = {"num_requests_running": "num_requests_running", "num_requests_waiting": "num_requests_waiting",
               "kv_cache_usage_perc": "kv_cache_usage_perc", "gpu_cache_usage_perc": "kv_cache_usage_perc"}
    for name, own in aliases.items():
        assert value(stack, now, "scheduler", f"vllm:{name}") == value(stack, now, "scheduler", f"ringserve:{own}")
    blocks = str(stack.scheduler_load().kv_total_tokens // 16)
    info = (("block_size", "16"), ("model_name", stack.model_name), ("num_gpu_blocks", blocks))
    assert now["scheduler"][("vllm:cache_config_info", info)] == 1


def exercise(stack) -> None:
    """One streamed request that finishes and one cut off after its first token, so that
    every labelled family (a counter's first child appears on first use) has a sample."""
    body = {"model": stack.model_name, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    assert httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=60).status_code == 200
    with httpx.Client(base_url=stack.base_url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={**body, "max_tokens": 400, "ignore_eos": True}) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            lines.close()
    stack.wait_idle()


def test_docs_list_exactly_the_exported_metrics(stack):
    exercise(stack)
    exported = exported_names(stack)
    listed = documented_metrics()
    assert len(listed) >= 30
    assert listed <= exported, f"listed in docs/metrics.md, not exported: {sorted(listed - exported)}"
    # Families as queried: counters with _total, histograms and gauges by their own name.
    families = {n for n in exported if not re.search(r"_(bucket|count|sum|created)$", n)}
    families -= {n[: -len("_total")] for n in families if n.endswith("_total")}
    assert families <= listed, f"exported, missing from docs/metrics.md: {sorted(families - listed)}"


def test_dashboard_queries_only_exported_metrics(stack):
    exercise(stack)
    exported = exported_names(stack)
    dash = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    exprs = [variables["model_name"]["definition"]]
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    titles = " | ".join(p["title"] for p in panels)
    for wanted in ("Time to first token", "Inter-token latency", "Tokens per second", "queue depth",
                   "KV cache usage", "Prefix cache hit rate", "Stage latency"):
        assert wanted in titles
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"]
            assert 'model_name=~"$model_name"' in t["expr"], t["expr"]
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            exprs.append(t["expr"])
    used = {n for e in exprs for n in NAME.findall(e)}
    assert len(used) >= 20
    assert used <= exported, f"queried, not exported: {sorted(used - exported)}"
    stages = {n for n in used if n.endswith("_time_seconds_bucket")}
    assert {s.split(":")[1].split("_time")[0] for s in stages} == {
        "request_tokenize", "request_dispatch", "request_queue", "request_prefill", "request_decode",
        "detokenize_step", "request_send"}

