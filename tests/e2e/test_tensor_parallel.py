"""A SmolLM2 replica over 3 tensor-parallel ranks (gloo, one thread each), through the whole ring.

The ring runs with 16-token prefill chunks and a 256-row KV pool, so three 64-token answers
at once are chunk-prefilled, share their system prompt through the prefix cache and force
retractions; a stream is cut off on the way (an abort). Every answer must equal the session
ring's (``--tp-size 1``) token for token, with logprobs within 1e-4. Last, a rank is
SIGKILLed mid-stream: the requests in flight end with service_unavailable_error within 2 s
and ``--restart-on-failure`` brings the group back.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import psutil

from tests.helpers.ring_requests import chat, post, read_events, read_stream, serves_again, wait_until
from tests.helpers.ringstack import launched
from tests.helpers.tiers import ring_fixture

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]


@ring_fixture(scope="module")
def tp_ring(smollm2_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("tp") / "ring.log"
    with launched(smollm2_dir, "--tp-size", "3", "--restart-on-failure", "--chunked-prefill-size", "16",
                  "--max-total-tokens", "256", "--grace-period", "2", log_path=log) as ring:
        yield ring


def answer(ring, question: str, max_tokens: int = 64, **extra) -> dict:
    return chat(ring, [{"role": "user", "content": question}], max_tokens=max_tokens, ignore_eos=True,
                logprobs=True, top_logprobs=2, **extra)


def tokens(resp: httpx.Response) -> tuple[str, list[str], list[float]]:
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    content = choice["logprobs"]["content"]
    return choice["message"]["content"], [t["token"] for t in content], [t["logprob"] for t in content]


def test_tp3_answers_equal_tp1(tp_ring, stack):
    async def together(ring, abort: bool) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=ring.base_url, timeout=300) as client:
            if abort:
                cut = asyncio.create_task(read_events(client, answer(ring, "Tell me a story.", 150, stream=True), 3))
            resps = await asyncio.gather(*(client.post("/v1/chat/completions", json=answer(ring, q))
                                           for q in QUESTIONS))
            if abort:
                assert len(await cut) == 3
            return resps

    reference = [tokens(resp) for resp in asyncio.run(together(stack, abort=False))]
    label = (("model_name", tp_ring.model_name),)
    retractions = tp_ring.scrape("scheduler")[("ringserve:num_retractions_total", label)]
    resps = asyncio.run(together(tp_ring, abort=True))
    for resp, (text, toks, logprobs) in zip(resps, reference, strict=True):
        got_text, got_toks, got_logprobs = tokens(resp)
        assert (got_text, got_toks) == (text, toks) and len(toks) == 64
        assert max(abs(a - b) for a, b in zip(got_logprobs, logprobs, strict=True)) < 1e-4
    again = httpx.post(f"{tp_ring.base_url}/v1/chat/completions", json=answer(tp_ring, QUESTIONS[0], 4), timeout=120)
    assert tokens(again)[1] == reference[0][1][:4]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 20  # the prefix cache's hit
    metrics = tp_ring.scrape("scheduler")
    assert metrics[("ringserve:num_retractions_total", label)] > retractions
    assert metrics[("ringserve:tp_size", label)] == 3
    _, sched, _ = tp_ring.wait_idle()
    assert (sched.tp_size, sched.kv_used_tokens, sched.req_slots_used) == (3, 0, 0)


def worker_ranks(ring) -> list[psutil.Process]:
    """Ranks 1 and 2: the children of the scheduler's multiprocessing fork server."""
    server = [p for p in psutil.Process(ring.pid("scheduler")).children() if "forkserver" in " ".join(p.cmdline())]
    assert len(server) == 1
    return server[0].children()


async def test_rank_killed_mid_stream(tp_ring):
    """Last in the module: a rank dies; both requests in flight end fast; the group comes back."""
    tp_ring.wait_idle()
    scheduler = tp_ring.pid("scheduler")
    ranks = worker_ranks(tp_ring)
    assert len(ranks) == 2
    async with httpx.AsyncClient(base_url=tp_ring.base_url, timeout=60) as client:
        streamed = asyncio.create_task(read_stream(client, answer(tp_ring, "Write a long story.", 200, stream=True)))
        whole = asyncio.create_task(post(client, answer(tp_ring, "Write a long poem.", 200)))
        await wait_until(lambda: tp_ring.scheduler_load().num_running_reqs == 2, 30, "running 2")
        await asyncio.sleep(0.3)
        killed_at = time.monotonic()
        ranks[1].send_signal(signal.SIGKILL)
        events, stream_end = await asyncio.wait_for(streamed, 10)
        resp, whole_end = await asyncio.wait_for(whole, 10)
    assert stream_end - killed_at < 2.0 and whole_end - killed_at < 2.0, (stream_end - killed_at, whole_end - killed_at)
    assert events[-2]["error"]["type"] == "service_unavailable_error", events[-2:]
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "service_unavailable_error", resp.text
    assert not tp_ring.serving("scheduler")
    await serves_again(tp_ring)
    assert tp_ring.pid("scheduler") != scheduler and len(worker_ranks(tp_ring)) == 2
    assert "tensor-parallel" in tp_ring.log()
