"""The scheduler's Prometheus metrics: engine occupancy read at scrape time, request
stage latencies and token counters fed by the engine's hooks (``EngineObserver``).

Definitions follow vLLM's v1 engine metrics:

- queue time: from the request joining the engine's waiting queue to the start of the
  step that first schedules it;
- prefill time: from that step's start to the forward pass that completes its prompt
  (the step that samples its first token);
- decode time: from there to the request's end (any finish reason);
- prefix cache queries / hits: at a request's first admission, its prompt tokens and the
  prompt tokens the radix cache supplied (``usage.prompt_tokens_details.cached_tokens``);
- KV cache usage: rows held by requests over the pool's rows; rows only the prefix
  cache holds are evictable and count as free;
- KV cache geometry (``cache_config_info``, vLLM's labels): the pool is token-granular, and
  its blocks are counted in the pages the KV events group (``ringserve.kv_events.PAGE_SIZE``
  tokens), so a router indexing those events and sizing the cache agree:
  ``block_size * num_gpu_blocks`` is the pool's rows rounded down to a page.

The model server protocol's names of some gauges (``vllm:*``) come from
``ringserve.metrics.ALIASES``.

Cost: one dict entry per in-flight request; per step a loop over the extend rows only
(decode rows are counted with ``len``); two histogram observations per request.
"""

from __future__ import annotations

import time

from prometheus_client import Counter

from ringserve.kv_events import PAGE_SIZE
from ringserve.metrics import PREFIX, Read, ServiceMetrics
from services.scheduler.engine.engine import Engine
from services.scheduler.engine.observer import EngineObserver
from services.scheduler.lora.metrics import LoraInfoCollector
from services.scheduler.policy.req import FinishType, Req
from services.scheduler.policy.schedule import Plan
from services.scheduler.speculative.speculator import SpecStats

_REASONS = {FinishType.STOP: "stop", FinishType.LENGTH: "length", FinishType.ABORT: "abort"}


class SchedulerMetrics(EngineObserver):
    """Installs itself as ``engine.observer`` and registers the scheduler's families in
    ``metrics.registry``.

    Args:
        engine: the engine to observe (its hooks run in the engine thread; the scrape-time
            reads in the HTTP server's thread only read ints and lengths).
        metrics: the service's registry and endpoint.
    """

    def __init__(self, engine: Engine, metrics: ServiceMetrics):
        self.engine = engine
        self._times: dict[Req, list[float]] = {}  # req -> [queued, first scheduled, first token]
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        m = metrics
        idle = SpecStats()

        def spec() -> SpecStats:
            return engine.speculator.stats if engine.speculator is not None else idle

        self.queue_time = m.histogram(
            "request_queue_time_seconds",
            "Seconds from joining the scheduler's waiting queue to the first step that schedules the request.")
        self.prefill_time = m.histogram(
            "request_prefill_time_seconds",
            "Seconds from the first step that schedules a request to the forward pass that completes its prompt.")
        self.decode_time = m.histogram("request_decode_time_seconds",
                                       "Seconds from a request's first token to its end.")
        compile_time = m.histogram(
            "grammar_compile_time_seconds",
            "Seconds one output constraint took to compile and take its first step (worker thread; cache hits not "
            "counted).")
        engine.grammars.observe_compile = compile_time.observe
        finished = Counter(PREFIX + "scheduler_requests_finished",
                           "Requests that left the scheduler, by finish reason.",
                           ["model_name", "finished_reason"], registry=m.registry)
        self._finished = {t: finished.labels(m.model_name, name) for t, name in _REASONS.items()}
        max_loras = engine.cfg.max_loras if engine.lora is not None else 0
        m.registry.register(LoraInfoCollector(engine, m.model_name, max_loras))
        load = engine.load
        m.add_reads([
            Read("num_requests_running", "Requests in the running batch (a chunk-prefilling one included).", "gauge",
                 lambda: load().num_running_reqs),
            Read("num_requests_waiting", "Requests waiting for a request slot or KV room.", "gauge",
                 lambda: load().num_waiting_reqs),
            Read("num_prompt_tokens_waiting", "Prompt tokens of the requests waiting for a request slot or KV room "
                 "(a retracted request's output included): the prefill tier's autoscaling signal.", "gauge",
                 lambda: engine.policy.waiting.tokens),
            Read("req_slots_used", "Request slots in use.", "gauge", lambda: engine.req_pool.used),
            Read("tp_size", "Tensor-parallel ranks of this replica (--tp-size); rank 0 alone reports.", "gauge",
                 lambda: engine.tp.size),
            Read("req_slots_total", "Request slots (--max-running-requests).", "gauge",
                 lambda: engine.cfg.max_running_requests),
            Read("kv_cache_usage_perc", "KV cache usage: rows held by requests over all rows (1 = full; rows only "
                 "the prefix cache holds count as free).", "gauge", self._kv_usage),
            Read("kv_used_tokens", "KV cache rows (tokens) held by requests.", "gauge",
                 lambda: load().kv_used_tokens),
            Read("kv_cached_tokens", "KV cache rows (tokens) held only by the prefix cache: evictable.", "gauge",
                 lambda: load().kv_cached_tokens),
            Read("kv_total_tokens", "KV cache rows (tokens) in the pool (--max-total-tokens).", "gauge",
                 lambda: engine.kv_pool.size),
            Read("prefix_cache_queries", "Prompt tokens looked up in the prefix cache (at each request's first "
                 "admission).", "counter", lambda: self.prefix_cache_queries),
            Read("prefix_cache_hits", "Prompt tokens the prefix cache supplied.", "counter",
                 lambda: self.prefix_cache_hits),
            Read("scheduler_prompt_tokens", "Prompt tokens prefilled (counted once per request, when its prompt "
                 "completes).", "counter", lambda: self.prompt_tokens),
            Read("scheduler_generation_tokens", "Tokens sampled (accepted draft tokens included).", "counter",
                 lambda: self.generation_tokens + spec().accepted),
            Read("num_retractions", "Requests retracted (preempted) to free KV cache for running decodes, or under "
                 "--schedule-policy priority for a higher-priority prompt.", "counter",
                 lambda: engine.policy.num_retracted),
            Read("num_decode_steps", "Steps that decoded at least one request.", "counter",
                 lambda: engine.num_decode_steps),
            # The start-up memory split of the scheduler's device (executor.device.MemorySplit).
            Read("memory_weights_bytes", "Bytes the model's weights take on the scheduler's device.", "gauge",
                 lambda: engine.memory.weights),
            Read("memory_kv_cache_bytes", "Bytes the KV pool takes on the scheduler's device.", "gauge",
                 lambda: engine.memory.kv_cache),
            Read("memory_reserve_bytes", "Bytes kept for activations, logits and CUDA graphs (0 on CPU).", "gauge",
                 lambda: engine.memory.reserve),
            Read("memory_total_bytes", "The device's memory (CPU: what was available before the KV pool).",
                 "gauge", lambda: engine.memory.total),
            Read("cache_config_info", "The KV cache's geometry in its labels (1): block_size (tokens per block) and "
                 "num_gpu_blocks (blocks in the pool).", "gauge", lambda: 1,
                 labels=lambda: {"block_size": str(PAGE_SIZE),
                                 "num_gpu_blocks": str(engine.kv_pool.size // PAGE_SIZE)}),
            # Speculative decoding (services/scheduler/speculative/; all 0 without it).
            Read("speculative_draft_tokens", "Draft tokens proposed and verified.", "counter",
                 lambda: spec().proposed),
            Read("speculative_accepted_tokens", "Draft tokens the target model accepted.", "counter",
                 lambda: spec().accepted),
            Read("speculative_drafts", "Rows that verified drafts (one per request and step).", "counter",
                 lambda: spec().verify_rows),
            Read("speculative_acceptance_length", "Mean tokens a row that verified drafts emitted per step "
                 "(1 + accepted drafts), since start.", "gauge", lambda: spec().acceptance_length),
            Read("num_requests_compiling", "Requests waiting for their output constraint to compile (also counted "
                 "in num_requests_waiting).", "gauge", lambda: engine.grammars.num_pending),
        ])
        engine.observer = self

    def _kv_usage(self) -> float:
        load = self.engine.load()
        return load.kv_used_tokens / load.kv_total_tokens if load.kv_total_tokens else 0.0

    # ---- engine hooks (engine thread) ---------------------------------------------
    def on_queued(self, req: Req) -> None:
        self._times[req] = [time.monotonic(), 0.0, 0.0]

    def on_step(self, plan: Plan, started: float) -> None:
        now = time.monotonic()
        n = plan.num_extend
        sampled = len(plan.reqs) - n + plan.num_drafted  # one token per decode row (accepted drafts: at the read)
        for req, prefix_len, extend_len in zip(plan.reqs[:n], plan.prefix_lens[:n], plan.extend_lens[:n], strict=True):
            t = self._times.get(req)
            if t is None:
                continue
            if not t[1]:
                t[1] = started
                self.queue_time.observe(started - t[0])
                self.prefix_cache_queries += req.prompt_len
                self.prefix_cache_hits += req.cached_tokens or 0
            if prefix_len + extend_len == req.seq_len:  # the prompt (and any output) is in: it samples
                sampled += 1
                if not t[2]:
                    t[2] = now
                    self.prefill_time.observe(now - t[1])
                    self.prompt_tokens += req.prompt_len
        self.generation_tokens += sampled

    def on_finish(self, req: Req) -> None:
        self._finished[req.finish_reason.type].inc()
        t = self._times.pop(req, None)
        if t is not None and t[2]:
            self.decode_time.observe(time.monotonic() - t[2])
