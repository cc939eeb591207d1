"""Scheduler configuration: frozen dataclasses, parsed once from flags in ``main``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ringserve.grpcutil import Transport
from ringserve.internal_auth import InternalAuth

DTYPES = ("auto", "float32", "bfloat16", "float16")  # float16 on CUDA only
SCHEDULE_POLICIES = ("fcfs", "lpm")
LOAD_FORMATS = ("auto", "dummy")
# "auto" and the names of layers.attention_backend.ATTENTION_BACKENDS (kept torch-free here).
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
# Keys of engine.grammar_backends.GRAMMAR_BACKENDS (kept import-free here).
GRAMMAR_BACKENDS = ("llguidance", "xgrammar")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs; gRPC-free.

    Attributes:
        max_total_tokens: KV pool size in tokens; None = from ``kv_cache_gib``.
        kv_cache_gib: KV pool size in GiB; None = on CPU ``kv_cache_mem_fraction`` of the
            memory available once the weights are loaded (MemAvailable, capped by a cgroup
            limit); on CUDA what ``mem_fraction_static`` of the device's total memory leaves
            after the weights and the activation / CUDA-graph reserve.
            For SmolLM2-135M a token's K and V over 30 layers take 23 KiB in bf16 (46 KiB
            in fp32). The pool is address space, committed only as tokens are first
            written, and never grows past its size.
        max_prefill_tokens: token budget of one extend batch.
        context_length: None = the model's max_position_embeddings.
        seed: seed of the shared generator for unseeded requests; None = nondeterministic.
        device: "auto" (the first CUDA device torch sees, else the CPU), "cpu", "cuda" or
            "cuda:N" (``engine.device``).
        dtype: "auto" = on CUDA bfloat16 at compute capability >= 8.0, else float16; on
            CPU bfloat16 with AMX / AVX-512-BF16, float32 elsewhere. float16 runs on CUDA only.
        chunked_prefill_size: most prompt tokens one step prefills; <= 0 disables chunking.
        disable_radix_cache: run without the prefix cache.
        schedule_policy: admission order, "fcfs" or "lpm" (longest cached prefix first).
        load_format: "auto" (safetensors) or "dummy" (random weights for config.json).
        attention_backend: "torch", "cpu" (C kernels), "triton", or "auto" = triton when
            the weights are on a CUDA device, cpu on CPU (torch when no C compiler is
            there; triton on CPU needs TRITON_INTERPRET=1).
        mem_fraction_static: CUDA: the fraction of the device's memory that weights, KV
            pool and the reserve may take (SGLang's ``--mem-fraction-static``).
        cuda_graph_max_bs: CUDA: the largest decode batch replayed from a CUDA graph.
        disable_cuda_graph: CUDA: run every decode step eagerly.
        overlap_schedule: plan step N+1 while the device runs step N; None = on for CUDA,
            off on the CPU (whose forward holds the planning thread).
        grammar_backend: constrained decoding engine, "llguidance" or "xgrammar".
        grammar_compile_timeout_s: a constrained request waits at most this long for its
            grammar, then ends with INVALID_ARGUMENT.
        deterministic_inference: a request's tokens and logprobs do not depend on the rest of
            its batch, on chunk boundaries or on prefix-cache hits (batch-invariant
            attention and linears: ``layers.batch_invariant``); True needs the cpu or
            triton attention backend. None = on for a bf16 model on the CPU with the cpu
            backend (measured within 10 % of off), off elsewhere (``Engine``).
        quantization: None (the checkpoint's weights in ``dtype``) or "int8": every linear and
            the LM head quantized at load to per-output-channel int8, run as W8A8 or
            weight-only per shape and batch size (``layers.quant``); CPU with AVX-512-VNNI only.
    """

    model: Path
    dtype: str = "auto"
    max_running_requests: int = 64
    max_total_tokens: int | None = None
    kv_cache_gib: float | None = None
    kv_cache_mem_fraction: float = 0.3
    max_prefill_tokens: int = 8192
    context_length: int | None = None
    seed: int | None = None
    chunked_prefill_size: int = 2048
    disable_radix_cache: bool = False
    schedule_policy: str = "fcfs"
    load_format: str = "auto"
    attention_backend: str = "auto"
    device: str = "auto"
    mem_fraction_static: float = 0.85
    cuda_graph_max_bs: int = 160
    disable_cuda_graph: bool = False
    overlap_schedule: bool | None = None
    grammar_backend: str = "llguidance"
    grammar_compile_timeout_s: float = 5.0
    deterministic_inference: bool | None = None
    quantization: str | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    """The service: where it listens, where the detokenizer is, and its engine."""

    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 30020
    detokenizer: str = "127.0.0.1:30030"
    instance_id: str = "scheduler-0"
    load_report_interval_s: float = 1.0
    torch_threads: int | None = field(default=None)
    max_queued_requests: int | None = None  # None: no limit; beyond it RESOURCE_EXHAUSTED
    grace_period_s: float = 5.0  # on SIGTERM: refuse new requests, let in-flight ones finish this long
    watchdog_timeout_s: float | None = None  # NOT_SERVING after this long with work and no step done
    max_queued_tokens: int | None = None  # None: no limit; see EngineLoop (prompt tokens held)
    transport: Transport = Transport()  # gRPC message size and TLS, server and detokenizer channel
    metrics_port: int | None = None  # Prometheus /metrics on host:port; None = off, 0 = a free port
    served_model_name: str | None = None  # the metrics' model_name label; None = the model directory's name
    # Tokens every Scheduler call needs and the one presented to the detokenizer; empty: none.
    internal_auth: InternalAuth = InternalAuth()
    # Tensor parallelism (engine.tp): ranks of this replica; rank 0 hosts the rendezvous at
    # dist_init_addr:dist_port (0 = a free port); every collective times out after dist_timeout_s.
    tp_size: int = 1
    dist_init_addr: str = "127.0.0.1"
    dist_port: int = 0
    dist_timeout_s: float = 60.0

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model).name

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"
