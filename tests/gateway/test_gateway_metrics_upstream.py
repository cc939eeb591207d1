"""The gateway's /metrics with --metrics-upstream: a scheduler-style endpoint's families
(the model server protocol's vllm: names among them) appended to the gateway's own, and an
upstream that does not answer left out without failing the scrape."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ringserve.metrics import Read, ServiceMetrics
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from tests.helpers.ringstack import free_port

# It serves a Prometheus endpoint of its own (a thread, no model).
pytestmark = pytest.mark.ring


async def scrape(upstreams: tuple[str, ...]) -> dict[str, tuple[str, list]]:
    app = create_app(GatewayConfig(metrics_upstreams=upstreams))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        r = await client.get("/metrics")
    assert r.status_code == 200
    return {f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples])
            for f in text_string_to_metric_families(r.text)}


async def test_upstream_families_follow_the_gateways_own():
    upstream = ServiceMetrics("smol")
    waiting = [3]
    upstream.add_reads([Read("num_requests_waiting", "Queued.", "gauge", lambda: waiting[0])])
    port = upstream.serve("127.0.0.1", 0)
    dead = f"http://127.0.0.1:{free_port()}/metrics"
    try:
        got = await scrape((f"http://127.0.0.1:{port}/metrics", dead))
        assert got["vllm:num_requests_waiting"] == ("gauge", [("vllm:num_requests_waiting", {"model_name": "smol"}, 3)])
        assert got["ringserve:num_requests_waiting"][1][0][2] == 3
        assert got["ringserve:gateway_requests_in_flight"][0] == "gauge"  # the gateway's own
        waiting[0] = 0  # read again at the next scrape
        assert (await scrape((f"http://127.0.0.1:{port}/metrics",)))["vllm:num_requests_waiting"][1][0][2] == 0
    finally:
        upstream.stop()
    # Without an answering upstream the gateway's families alone, still 200.
    alone = await scrape((dead,))
    assert "vllm:num_requests_waiting" not in alone and "ringserve:gateway_requests_in_flight" in alone
