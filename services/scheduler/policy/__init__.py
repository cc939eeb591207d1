"""Host-side policy: what the scheduler decides and records on the CPU, step by step.

- ``req``: a request and its state (ids, sampling parameters, finish reason); ``validate``:
  the checks a request passes before it is queued.
- ``schedule``: the plan of each step (``SchedulePolicy``: which requests extend or decode,
  chunked prefill, retraction, priority preemption) and its ``Plan``; ``waiting``: the
  waiting queue in admission order (arrival, or priority then arrival).
- ``kv_pool``: request slots and KV rows (free lists, the host req-to-token table and its
  queued writes; the pools also own the KV buffers and the table's device copy, which the
  executor reads and writes); ``radix_cache``: the prefix cache over KV rows.
- ``stops``: EOS, stop ids, stop strings and lengths; ``output``: the step's output rows.
- ``grammar``, ``grammar_backends``, ``grammar_gate``: constrained decoding's state (compiles,
  matchers, the host bitmasks; applying a mask to the logits takes the executor's copy
  function as an argument).

What goes here: code that decides which requests run and where their tokens live, and what a
step's results mean for them. It imports nothing from ``executor`` or ``engine``: the
executor consumes its ``Plan`` and ``Req``, never the reverse. The line is the one SGLang
draws with ``managers/`` and ``mem_cache/``, vLLM with ``v1/core/`` and mini-sglang with
``scheduler/``.
"""
