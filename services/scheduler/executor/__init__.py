"""Device execution: running the model for a plan, on the device the engine was built for.

- ``device``: the device runtime (``DeviceRuntime``: every difference between the CPU and a
  CUDA GPU that the engine sees, its memory and its copies).
- ``build``: the stack from the config (model, pools, runner, CUDA graphs, quantization,
  deterministic inference), and the memory sizing.
- ``model_runner``: a ``policy.schedule.Plan`` packed into one host-to-device copy, the
  forward and the logits.
- ``cuda_graph``: the decode forward captured per batch-size bucket.
- ``sampling``: the batched sampler on the device; ``prompt_logprobs``: prompt scoring.
- ``tp``: tensor parallelism: rank 0's group and the ranks > 0 (their own processes).

What goes here: code that launches work on the device or prepares it for the device. It
imports policy's data (``Plan``, ``Req``, the pools) and the model side (``models``,
``layers``, ``attention``, ``kernels``), never ``engine``; the model side in turn reads
``device`` alone, to build itself for the runtime's device. The line is SGLang's
``model_executor/``, vLLM's ``v1/worker/`` and ``v1/executor/``, mini-sglang's ``engine/``.
"""
