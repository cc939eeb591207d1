"""Several replicas of each tier: ``ringserve launch --tokenizers 2 --replicas 2``.

One ring for the module: a gateway balancing over two tokenizer instances (gRPC
round_robin), each talking to both model replicas (a scheduler with its detokenizer),
choosing one per request by least outstanding work, then prefix affinity. Outputs stay the
single ring's; load spreads over both replicas; a shared prefix lands where it is cached
(the second request's cached_tokens is the shared token count); SIGKILLing one replica's
scheduler fails only its in-flight requests, within 2 s, and new requests go to the other;
/get_load lists every instance; every instance's metrics export under the served name
(``--served-model-name ringtest``) and their sums move exactly.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time

import grpc
import httpx

from ringserve.v1 import common_pb2, scheduler_pb2_grpc
from tests.helpers.ring_requests import PARIS_ANSWER, PROMPT, chat, read_stream, wait_until
from tests.helpers.ringstack import launched
from tests.helpers.tiers import ring_fixture

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Write a haiku about the sea.",
]


@ring_fixture(scope="module")
def ring(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("replicas") / "ring.log"
    with launched(smollm2_dir, "--tokenizers", "2", "--replicas", "2", "--max-total-tokens", "8192",
                  "--restart-on-failure", "--served-model-name", "ringtest", log_path=log) as s:
        s.model_name = "ringtest"
        yield s


def scheduler_loads(ring) -> list[common_pb2.LoadReport]:
    """Fresh LoadReports of both schedulers, in replica order."""
    out = []
    for sched, _ in ring.replicas():
        with grpc.insecure_channel(sched) as ch:
            out.append(scheduler_pb2_grpc.SchedulerStub(ch).GetLoad(common_pb2.Empty(), timeout=5,
                                                                    metadata=ring.internal_metadata))
    return out


def finished_counts(ring) -> list[int]:
    return [load.num_finished_reqs for load in scheduler_loads(ring)]


def ask(ring, question: str, max_tokens: int = 24, stream: bool = False, **extra) -> dict:
    return chat(ring, [{"role": "user", "content": question}], max_tokens=max_tokens, stream=stream, **extra)


async def answers(base_url: str, ring) -> list[str]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        resps = await asyncio.gather(*(client.post("/v1/chat/completions", json=ask(ring, q)) for q in QUESTIONS))
    assert [r.status_code for r in resps] == [200] * len(QUESTIONS), [r.text for r in resps]
    return [r.json()["choices"][0]["message"]["content"] for r in resps]


async def test_topology_in_get_load(ring):
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=30) as client:
        load = (await client.get("/get_load")).json()
    assert sorted(load) == ["detokenizer", "scheduler", "tokenizer"]
    assert len({t["instance_id"] for t in load["tokenizer"]}) == 2
    assert sorted(s["instance_id"] for s in load["scheduler"]) == ["scheduler-0", "scheduler-1"]
    assert sorted(d["instance_id"] for d in load["detokenizer"]) == sorted(
        f"detokenizer@{socket.gethostname()}:{d.rsplit(':', 1)[1]}" for _, d in ring.replicas()
    )
    for s in load["scheduler"]:
        assert s["kv_total_tokens"] == 8192
        assert {"num_running_reqs", "num_waiting_reqs", "req_slots_used", "kv_used_tokens",
                "kv_cached_tokens"} <= set(s)
    assert all("req_states" in t for t in load["tokenizer"]) and all("decode_states" in d for d in load["detokenizer"])


def test_every_instance_exports_under_the_served_name(ring):
    """``--served-model-name``: the launcher prints a metrics URL per process; each exports
    under the served name, and the sums over instances move exactly with 4 requests."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + 10  # the launcher prints the URLs just after the gateway is healthy
    while len(urls := dict(re.findall(r"^ringserve: (\S+) metrics at (\S+)$", ring.log(), re.MULTILINE))) < 7:
        assert time.monotonic() < deadline, urls
        time.sleep(0.1)
    assert sorted(urls) == ["detokenizer-0", "detokenizer-1", "gateway", "scheduler-0", "scheduler-1",
                            "tokenizer-0", "tokenizer-1"]
    assert len(set(urls.values())) == 7

    def total(prefix: str, name: str) -> float:
        out = 0.0
        for process, url in urls.items():
            if not process.startswith(prefix):
                continue
            for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
                for s in family.samples:
                    if s.name.startswith("ringserve:"):
                        assert s.labels["model_name"] == "ringtest", (process, s.name)
                    if s.name == name:
                        out += s.value
        return out

    counters = [("scheduler", "ringserve:scheduler_prompt_tokens_total"),
                ("scheduler", "ringserve:scheduler_generation_tokens_total"),
                ("scheduler", "ringserve:scheduler_requests_finished_total"),
                ("detokenizer", "ringserve:detokenize_step_time_seconds_count"),
                *(("tokenizer", f"ringserve:request_{stage}_time_seconds_count")
                  for stage in ("tokenize", "dispatch", "send")),
                ("gateway", "ringserve:generation_tokens_total")]
    ring.wait_idle()
    before = {c: total(*c) for c in counters}

    def moved(prefix: str, name: str) -> float:
        return total(prefix, name) - before[(prefix, name)]

    usages = []
    for i in range(4):
        body = {"model": "ringtest", "prompt": f"{PROMPT} ({i})", "max_tokens": 3, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(f"{ring.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        usages.append(r.json()["usage"])

    deadline = time.monotonic() + 10
    held = ("tokenizer", "ringserve:req_states"), ("detokenizer", "ringserve:decode_states"), (
        "scheduler", "ringserve:req_slots_used")
    # The last states are dropped, and the last dispatch and send times observed, around the responses.
    while any(total(*h) for h in held) or moved("tokenizer", "ringserve:request_send_time_seconds_count") < 4 \
            or moved("tokenizer", "ringserve:request_dispatch_time_seconds_count") < 4:
        assert time.monotonic() < deadline, [total(*h) for h in held]
        time.sleep(0.05)
    assert moved("scheduler", "ringserve:scheduler_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert moved("scheduler", "ringserve:scheduler_generation_tokens_total") == 12
    assert moved("scheduler", "ringserve:scheduler_requests_finished_total") == 4
    assert moved("detokenizer", "ringserve:detokenize_step_time_seconds_count") == 12
    for stage in ("tokenize", "dispatch", "send"):
        assert moved("tokenizer", f"ringserve:request_{stage}_time_seconds_count") == 4
    assert moved("gateway", "ringserve:generation_tokens_total") == 12


async def test_greedy_outputs_equal_the_single_ring(ring, stack):
    single, replicated = await asyncio.gather(answers(stack.base_url, stack), answers(ring.base_url, ring))
    assert replicated == single
    assert replicated[0] == PARIS_ANSWER
    ring.wait_idle()


async def test_concurrent_load_spreads_over_both_replicas_and_both_tokenizers(ring):
    before = finished_counts(ring)
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=120) as client:
        body = ask(ring, "Write a very long story.", max_tokens=48, stream=True, ignore_eos=True)
        streams = [asyncio.create_task(read_stream(client, body)) for _ in range(4)]

        async def all_running() -> dict:
            while True:
                load = (await client.get("/get_load")).json()
                if sum(s["num_running_reqs"] for s in load["scheduler"]) == 4:
                    return load
                await asyncio.sleep(0.05)

        load = await asyncio.wait_for(all_running(), 60)
        results = await asyncio.gather(*streams)
    # Both tokenizers got calls (round_robin) and both replicas run requests at once.
    assert sorted(t["req_states"] > 0 for t in load["tokenizer"]) == [True, True], load["tokenizer"]
    assert [s["num_running_reqs"] for s in load["scheduler"]] == [2, 2], load["scheduler"]
    for events, _ in results:
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    after = finished_counts(ring)
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2]
    ring.wait_idle()


async def test_a_shared_prefix_lands_on_the_replica_that_caches_it(ring):
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=120) as client:
        for lead in ("Alpha", "Bravo", "Charlie"):
            sections = " ".join(f"Section {i} lists the stations of the northern line." for i in range(20))
            shared = f"{lead} report. " + sections
            prompts = [f"{shared} Summary of the first part:", f"{shared} Questions about the second part:"]
            ids = [(await client.post("/v1/tokenize", json={"prompt": p})).json()["tokens"] for p in prompts]
            common = next(i for i, (a, b) in enumerate(zip(*ids, strict=False)) if a != b)
            assert common > 200
            landed, cached = [], []
            for prompt in prompts:  # one after the other: both replicas idle, so affinity decides
                before = finished_counts(ring)
                resp = await client.post("/v1/completions", json={
                    "model": ring.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0})
                assert resp.status_code == 200, resp.text
                cached.append(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
                after = finished_counts(ring)
                landed.append([i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a != b])
            assert landed[0] == landed[1] and len(landed[0]) == 1, landed
            assert cached == [0, common]


async def test_killing_one_replica_fails_only_its_requests(ring):
    ring.wait_idle()
    (sched0, _), (sched1, _) = ring.replicas()
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=120) as client:
        bodies = [ask(ring, f"Write a very long story about the number {i}.", max_tokens=160, stream=True,
                      ignore_eos=True) for i in range(4)]
        started = [asyncio.Event() for _ in bodies]
        streams = [asyncio.create_task(read_stream(client, b, e)) for b, e in zip(bodies, started, strict=True)]
        await wait_until(lambda: [s.num_running_reqs for s in scheduler_loads(ring)] == [2, 2], 60, "2 + 2 running")
        # Every stream has its 200 and a first event: the kill cuts streams, not responses not
        # begun (a 503 before the first output), whatever the load delays the first token by.
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        finished1 = scheduler_loads(ring)[1].num_finished_reqs
        killed_at = time.monotonic()
        ring.kill("scheduler", sched0)
        done, _ = await asyncio.wait(streams, timeout=2.0)
        failed = [t for t in done if t.result()[0][-2].get("error")]
        assert len(failed) == 2 and all(t.result()[1] - killed_at < 2.0 for t in failed)
        for task in failed:
            events, _ = task.result()
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["type"] == "service_unavailable_error", events[-2]
            assert f"lost the connection to the scheduler at {sched0}" in events[-2]["error"]["message"]

        # New requests go to the replica that is up (scheduler-0 is still restarting).
        resps = await asyncio.gather(*(client.post("/v1/chat/completions", json=ask(ring, QUESTIONS[0]))
                                       for _ in range(2)))
        assert [r.json()["choices"][0]["message"]["content"] for r in resps] == [PARIS_ANSWER, PARIS_ANSWER]

        survivors = await asyncio.wait_for(asyncio.gather(*(t for t in streams if t not in failed)), 120)
    for events, _ in survivors:
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert sum(len(e["choices"][0]["delta"].get("content") or "") > 0 for e in events[:-1]
                   if e.get("choices")) > 0
    with grpc.insecure_channel(sched1) as ch:
        load1 = scheduler_pb2_grpc.SchedulerStub(ch).GetLoad(common_pb2.Empty(), timeout=5,
                                                             metadata=ring.internal_metadata)
    assert load1.num_finished_reqs - finished1 == 4  # the 2 survivors and the 2 new requests
    ring.wait_serving("scheduler")  # scheduler-0 came back (--restart-on-failure)
