"""The gateway's ``/metrics`` extended with other endpoints' expositions (``--metrics-upstream``).

When a pod runs a whole ring (the Helm chart's ``inferencePool`` mode), the gateway's HTTP
port is the pod's only endpoint a Kubernetes endpoint picker knows: it sends the OpenAI
requests there and scrapes ``/metrics`` there for the queue depth, running requests and KV
cache usage, which the scheduler of that pod exports. So each scrape of the gateway fetches
the scheduler's ``/metrics`` (on loopback) and appends it to the gateway's own families, as
Prometheus federation would, but in one scrape the picker already makes.

Family names do not collide: the gateway's and the scheduler's ``ringserve:`` families are
disjoint (docs/metrics.md), and the gateway registers no ``process_*`` collector. An upstream
that does not answer within the timeout is left out of that scrape (logged), so the
gateway's liveness probe, which reads ``/metrics`` with a 1 s timeout, never follows the
scheduler: the fetch gives up after half of that.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

log = logging.getLogger(__name__)


class UpstreamMetrics:
    """Fetches the Prometheus text of ``urls`` at each scrape.

    Args:
        urls: ``http://host:port/metrics`` endpoints, appended in this order.
        timeout_s: per fetch; an upstream slower than this is left out of the scrape.
    """

    def __init__(self, urls: tuple[str, ...], timeout_s: float = 0.5) -> None:
        self.urls = urls
        self._client = httpx.AsyncClient(timeout=timeout_s)

    async def exposition(self) -> bytes:
        """The upstreams' expositions, concatenated (b"" when none answers)."""
        parts = await asyncio.gather(*(self._fetch(url) for url in self.urls))
        return b"".join(parts)

    async def _fetch(self, url: str) -> bytes:
        try:
            r = await self._client.get(url)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            log.warning("metrics upstream %s left out of this scrape: %s", url, exc)
            return b""
        body = r.content
        return body if body.endswith(b"\n") or not body else body + b"\n"

    async def aclose(self) -> None:
        """Close the HTTP client's connections."""
        await self._client.aclose()
