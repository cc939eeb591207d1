"""The built images as containers (``make test-images``; not part of ``make test``).

What a cluster relies on: the three front images carry no torch; every image runs as a
non-root user with a health check; the README's curl and OpenAI SDK examples and a direct
gRPC client (API key) get their answers through the four containers; each service's
``/metrics`` answers; ``docker stop`` of the gateway drains it (in-flight streams finish, new
requests get 503, exit status 0); ``docker kill`` of the scheduler ends in-flight requests
with 503 within 2 s, and the ring serves again once the container is started again.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.docker.tests.containers import API_KEY, GRACE_PERIOD_S, IMAGES, METRICS_PORTS, MODEL, Ring, docker, report
from ringserve.client import RingserveClient

REPO = Path(__file__).resolve().parents[3]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def readme_block(lang: str, marker: str) -> str:
    """The README's first ``lang`` code block that contains ``marker``."""
    for block in re.findall(rf"```{lang}\n(.*?)```", (REPO / "README.md").read_text(), re.S):
        if marker in block:
            return block
    raise AssertionError(f"README.md has no {lang} block with {marker!r}")


@pytest.mark.parametrize("service", ["gateway", "tokenizer", "detokenizer"])
def test_front_images_carry_no_torch(service: str) -> None:
    probe = ("import importlib.util, sys; import services." + service + ".main; "
             "sys.exit(importlib.util.find_spec('torch') is not None or 'torch' in sys.modules)")
    docker("run", "--rm", "--network", "none", "--entrypoint", "python", IMAGES[service], "-c", probe)


@pytest.mark.parametrize("service", ["gateway", "tokenizer", "detokenizer", "scheduler"])
def test_images_run_as_non_root_with_a_healthcheck(service: str) -> None:
    config = json.loads(docker("image", "inspect", "-f", "{{json .Config}}", IMAGES[service]).stdout)
    assert config["User"] == "10001:10001"
    assert config["Healthcheck"]["Test"][0] == "CMD" and "127.0.0.1" in config["Healthcheck"]["Test"][-1]
    assert config["Entrypoint"] == ["ringserve", service]
    assert docker("run", "--rm", "--entrypoint", "id", IMAGES[service], "-u").stdout.strip() == "10001"


def test_readme_curl_example(ring: Ring) -> None:
    curl = readme_block("sh", "curl http://127.0.0.1:8000/v1/chat/completions")
    curl = curl.replace("http://127.0.0.1:8000", ring.base_url).replace(
        "curl ", f"curl -sS --fail-with-body -H 'Authorization: Bearer {API_KEY}' ", 1)
    out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    body = json.loads(out.stdout)
    assert body["model"] == MODEL and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == 2
    assert "Tokyo" in choice["message"]["content"], choice


def test_readme_openai_sdk_example(ring: Ring) -> None:
    code = readme_block("python", "from openai import OpenAI")
    code = code.replace("http://127.0.0.1:8000/v1", f"{ring.base_url}/v1").replace('api_key="unused"',
                                                                                    f'api_key="{API_KEY}"')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Tokyo" in out.stdout, out.stdout


def test_grpc_client_with_an_api_key(ring: Ring) -> None:
    with RingserveClient(ring.grpc_target, api_key=API_KEY) as client:
        chunks = list(client.chat([{"role": "user", "content": "What is the capital of Japan?"}],
                                  max_new_tokens=16, temperature=0.0, timeout_s=60))
    assert "Tokyo" in "".join(c.text for c in chunks)
    with RingserveClient(ring.grpc_target) as client, pytest.raises(grpc.RpcError) as refused:
        list(client.chat([{"role": "user", "content": "Hi"}], max_new_tokens=1, timeout_s=30))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def samples(url: str) -> dict[str, float]:
    """Every sample of a /metrics page: 'name{label="value",...}' -> value."""
    resp = httpx.get(url, timeout=10)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def test_metrics_of_every_service(ring: Ring) -> None:
    label = f'model_name="{MODEL}"'
    gateway = samples(f"{ring.base_url}/metrics")
    assert gateway[f'ringserve:request_success_total{{finished_reason="stop",{label}}}'] >= 2  # curl and the SDK
    assert gateway[f"ringserve:gateway_requests_in_flight{{{label}}}"] == 0
    tokenizer = samples(f"http://127.0.0.1:{METRICS_PORTS['tokenizer']}/metrics")
    assert tokenizer[f"ringserve:ready{{{label}}}"] == 1
    scheduler = samples(f"http://127.0.0.1:{METRICS_PORTS['scheduler']}/metrics")
    assert scheduler[f"ringserve:num_requests_running{{{label}}}"] == 0
    assert scheduler[f"ringserve:req_slots_total{{{label}}}"] > 0
    detokenizer = samples(f"http://127.0.0.1:{METRICS_PORTS['detokenizer']}/metrics")
    assert detokenizer[f"ringserve:decode_states{{{label}}}"] == 0


def story(max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream}


async def read_stream(client: httpx.AsyncClient, body: dict, first: asyncio.Event) -> tuple[list, float]:
    """POST a streamed chat; the parsed ``data:`` events (``"[DONE]"`` as is) and when it ended.
    ``first`` is set at the first event."""
    events: list = []
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=AUTH) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                first.set()
    return events, time.monotonic()


async def post(client: httpx.AsyncClient, body: dict) -> tuple[httpx.Response, float]:
    resp = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    return resp, time.monotonic()


async def test_docker_stop_drains_the_gateway(ring: Ring) -> None:
    name = ring.names["gateway"]
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=120) as client:
        # Streams of about 3 s at this machine's pace now, at least 24 tokens (a shared machine may
        # be 30 times slower than an idle one): they outlast the signal and end within the grace period.
        start = time.monotonic()
        resp, _ = await post(client, story(8, False))
        assert resp.status_code == 200, resp.text
        max_tokens = max(24, min(300, int(8 / (time.monotonic() - start) * 3)))
        firsts = [asyncio.Event(), asyncio.Event()]
        streams = [asyncio.create_task(read_stream(client, story(max_tokens, True), first)) for first in firsts]
        for first in firsts:
            await asyncio.wait_for(first.wait(), 60)
        stopped: dict[str, float] = {}
        stop = threading.Thread(target=lambda: (docker("stop", "-t", str(GRACE_PERIOD_S + 10), name),
                                                stopped.setdefault("at", time.monotonic())))
        stop_at = time.monotonic()
        stop.start()
        refused = None
        async with httpx.AsyncClient(base_url=ring.base_url, timeout=10) as other:
            while refused is None and time.monotonic() - stop_at < 10:  # until the signal has arrived
                resp = await other.post("/v1/chat/completions", json=story(1, False), headers=AUTH)
                refused = resp if resp.status_code == 503 else None
        assert refused is not None, "no 503 while draining"
        assert refused.json()["error"]["type"] == "service_unavailable_error" and "retry-after" in refused.headers
        results = await asyncio.gather(*streams)
    await asyncio.to_thread(stop.join, GRACE_PERIOD_S + 15)
    for events, end in results:  # every stream in flight at the signal ran to its end
        assert end > stop_at and events[-1] == "[DONE]", events[-2:]
        assert events[-2]["choices"][0]["finish_reason"] == "length", events[-2:]
    logs = docker("logs", name)
    drained = re.search(r"SIGTERM: draining (\d+) in-flight request\(s\)", logs.stdout + logs.stderr)
    assert drained is not None and int(drained[1]) >= 2, "the streams were not in flight at the signal"
    exit_code = docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
    assert exit_code == "0"
    streams_end = max(end for _, end in results) - stop_at
    assert streams_end < GRACE_PERIOD_S and stopped["at"] - stop_at < GRACE_PERIOD_S + 2
    report(f"gateway drain: docker stop -> in-flight streams ({max_tokens} tokens) finished {streams_end:.2f} s, "
           f"container exited {stopped['at'] - stop_at:.2f} s (status {exit_code}; grace period {GRACE_PERIOD_S} s)")
    docker("start", name)
    ring.wait_serving(60)


async def test_docker_kill_of_the_scheduler(ring: Ring) -> None:
    name = ring.names["scheduler"]
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=120) as client:
        first = asyncio.Event()
        streamed = asyncio.create_task(read_stream(client, story(2000, True), first))
        whole = asyncio.create_task(post(client, story(2000, False)))
        await asyncio.wait_for(first.wait(), 60)
        await asyncio.sleep(0.5)  # the non-streamed one is running too
        killed_at = time.monotonic()
        docker("kill", name)
        (events, stream_end), (resp, whole_end) = await asyncio.wait_for(asyncio.gather(streamed, whole), 10)
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "service_unavailable_error", events[-2:]
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable_error", resp.text
    ended = max(stream_end, whole_end) - killed_at
    assert ended < 2.0, ended
    started_at = time.monotonic()
    docker("start", name)
    back = ring.wait_serving(300)
    async with httpx.AsyncClient(base_url=ring.base_url, timeout=120) as client:
        resp, _ = await post(client, story(4, False))
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length", resp.text
    report(f"scheduler kill: in-flight requests ended with 503 {ended:.2f} s after docker kill; serving again "
           f"{back:.1f} s after docker start ({time.monotonic() - started_at:.1f} s to the first answer)")
