"""The scheduler: a GPU engine that also runs on the CPU.

Layout, by role (each package's docstring has its rule):

- ``policy``: host-side decisions and records -- requests, validation, the schedule of
  each step, request-slot and KV accounting, the radix prefix cache, stops, grammar state,
  output rows. It imports nothing from ``executor`` or ``engine``.
- ``executor``: device execution -- the device runtime, building the stack, the model
  runner, CUDA graphs, the sampler, prompt logprobs, tensor-parallel ranks. It runs
  policy's plan for policy's requests; which requests run is never its choice.
- ``engine``: orchestration -- ``Engine.step`` runs policy then executor then policy, and
  ``EngineLoop`` drives it in its own thread. Policy and executor meet here.
- the model side, which the executor builds and runs: ``models`` (one contract, the
  architectures and their weights), ``layers`` (the blocks models are made of),
  ``attention`` (per-step metadata and the attention backends), ``kernels`` (C and Triton
  kernels). Of the executor it reads only ``executor.device``, the runtime of the device
  it is built for.
- the service around the engine: ``main`` (flags, start-up, shutdown), ``servicer`` (gRPC),
  ``wire`` (protobuf <-> engine types), ``detok_link`` (the stream to the detokenizer),
  ``metrics``, ``config``, ``cpus``; ``triton_aot`` compiles the Triton kernels ahead of
  time on a machine without a GPU.

The line between ``policy`` and ``executor`` is where mini-sglang draws it (``scheduler/``
vs ``engine/``), vLLM (``core/`` vs ``worker/``) and SGLang (``managers/`` and
``mem_cache/`` vs ``model_executor/``).

What runs where in one step (``engine.Engine.step``), on a CUDA device:

- host: ``SchedulePolicy.schedule`` makes the plan (which requests extend or decode,
  their KV rows from the host free list, the req-to-token entries, which it writes into
  the host table and queues for the device copy); ``ModelRunner`` packs every index the
  step needs -- ids, positions, KV rows, req slots, lengths, the packed-token map, the
  rows that sample, the queued table writes -- into one int64 tensor.
- host to device: that tensor, once, pinned and ``non_blocking``
  (``executor.device.DeviceRuntime.to_device``); the table writes land in the device copy
  of the req-to-token table.
- device: the forward (embedding, rotary, norms, SiLU-and-mul as torch ops; attention as
  the Triton kernels, which read K/V through the req-to-token table in place), the LM
  head on the sampling rows, and the sampler (penalties, bias and min-token bans
  scattered from host-built (row, token) pairs, temperature, top-k/p, min-p, the
  exponential race with per-request generators on the device, logprobs).
- device to host: the sampled ids -- with the logprobs and top logprobs packed beside
  them when a request asked -- in one copy (``SampleResult.start_copy``: pinned memory and
  an event). Waiting for it is the one place the host waits for the device in a step.
- host: stops (EOS, stop ids, stop strings on decoded text, lengths), freeing finished
  requests into the prefix cache, the step's ``BatchTokenIDOutput``.

What is captured: the decode forward from embedding to logits, once per batch-size
bucket at start-up (``executor.cuda_graph``); a decode-only step of B requests copies its
inputs into the first B rows of static buffers, pads its bucket with rows that touch only
a padding row of the KV pool, and replays. Steps with an extend part run eagerly.

Nothing in the forward reads the device: every shape comes from host ints of the plan,
and ``tests/scheduler/test_device_placement.py`` runs a step sequence on fake CUDA
tensors, where any CPU/CUDA mix or data-dependent read raises. On the CPU the same code
runs with the copies as identities and the ``cpu`` attention backend's C kernels.

Overlap scheduling (SGLang's overlap scheduler; on by default on CUDA,
``--disable-overlap-schedule``): ``Engine.step`` plans and launches step N+1, then waits
for step N's sampled ids and processes them (stops, frees, the output rows), so the host's
planning and bookkeeping run while the device computes. Step N+1's decode rows whose last
token step N sampled take it on the device (``model_runner.FutureIds``); a request that
step N ends by length is left out of step N+1, and one that step N ends by a stop string or
EOS has its step N+1 row dropped and that KV row freed, not cached. A step that admits,
chunk-prefills or retracts, or a batch with a request whose sampling reads its own output
history (penalties, min tokens), first waits for step N, so every plan is the one made
without overlap (``tests/scheduler/test_overlap.py``: the same tokens, finish reasons and
gauges). On the CPU the forward holds the host thread, so overlap is off there by default.

Tensor parallelism (``--tp-size N``, ``executor.tp``, ``layers.parallel``): this process is
rank 0 and does all of the above; before each forward it broadcasts the packed int64 tensor
and the layouts' host ints (``model_runner.StepBatch``) over a gloo group, and ranks
1..N-1 run the same forward on their shard of every weight and their own KV pool (their
heads), with one all-reduce after o_proj and down_proj, the embedding's all-reduce and the
logits' all-gather. Sampling and every host structure stay on rank 0. CUDA graphs and
overlap scheduling are off under TP (the other ranks never see the sampled ids).
"""
