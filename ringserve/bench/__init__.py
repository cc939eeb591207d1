"""Serving benchmarks: ``ringserve bench serve`` (an OpenAI-endpoint load generator) and
``ringserve bench compare`` (ringserve against the baselines in ``bench/baselines``, run by
``make bench``).

The load generator follows SGLang's ``python/sglang/bench_serving.py`` and vLLM's
``vllm bench serve`` (``benchmarks/serve``): the same random-ids dataset, Poisson arrivals
under a concurrency cap, and the same definitions of TTFT, ITL, TPOT and E2E latency.
"""
