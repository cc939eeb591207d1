"""``ringserve:lora_requests_info``: the model server protocol's LoRA gauge (vLLM's ``vllm:lora_requests_info``).

The Kubernetes endpoint picker's LoRA affinity reads it: one sample whose labels name the
adapters of the running requests and of the waiting ones (comma-separated, sorted) and the
resident limit, valued with the time of the scrape in seconds (vLLM values it with the
time its label set was last updated; the picker reads the labels only).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ringserve.metrics import ALIASES, PREFIX

NAME = "lora_requests_info"
LABELS = ("model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora")


def adapter_names(reqs: Iterable) -> str:
    """The adapters of ``reqs`` (each a ``policy.req.Req``), sorted and comma-separated ("" for none)."""
    return ",".join(sorted({r.lora.name for r in reqs if r.lora is not None}))


class LoraInfoCollector(Collector):
    """Reads the engine's running and waiting requests at each scrape (from the HTTP server's
    thread: a list the engine thread changes meanwhile is read again).

    Args:
        engine: the ``Engine``; model_name: the ``model_name`` label every ringserve sample
            has (vLLM's gauge has none; the picker reads the other three); max_loras:
            ``--max-loras`` (0: LoRA off).
    """

    def __init__(self, engine, model_name: str, max_loras: int):
        self.engine = engine
        self.model_name = model_name
        self.max_loras = max_loras

    def collect(self) -> Iterator[GaugeMetricFamily]:
        policy = self.engine.policy
        for _ in range(3):
            try:
                running = adapter_names([*policy.running, *([policy.chunked] if policy.chunked else [])])
                waiting = adapter_names(list(policy.waiting))
                break
            except RuntimeError:  # changed while read
                continue
        else:
            running = waiting = ""
        doc = ("LoRA adapters of the running and the waiting requests, and --max-loras, as labels (the model "
               "server protocol's lora_requests_info); the value is the scrape's time in seconds.")
        now = time.time()
        for name in (PREFIX + NAME, *ALIASES[NAME]):  # the picker reads vLLM's name
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric([self.model_name, running, waiting, str(self.max_loras)], now)
            yield family
