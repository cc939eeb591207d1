"""The scheduler's options: ``ringserve scheduler`` (``EngineConfig`` and ``SchedulerConfig``
in services/scheduler/config.py subclass these)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ringserve.grpcutil import Transport
from ringserve.internal_auth import InternalAuth
from ringserve.modelfacts import POOLING_MODES
from ringserve.options import names
from ringserve.options.common import (
    BY_CHART,
    CONTEXT_LENGTH,
    GRACE_PERIOD,
    HOST,
    INSTANCE_ID_BY_CHART,
    INTERNAL_AUTH,
    LOG_REQUESTS,
    METRICS_PORT,
    MODEL,
    SERVED_MODEL_NAME,
    TRANSPORT,
    TracingOptions,
)
from ringserve.options.spec import Above, AtLeast, Fraction, Matches, option

EXTRA_ARGS = "a tuning knob: config.scheduler.extraArgs passes it"
TP_IN_POD = "a replica's tensor-parallel ranks run in its pod, which hosts their rendezvous on loopback"
DEVICE = Matches(r"auto|cpu|cuda(:\d+)?", "auto, cpu, cuda or cuda:N")


@dataclass(frozen=True, kw_only=True)
class EngineOptions:
    """What the engine is built from: model, memory, batching, kernels. gRPC-free."""

    model: Path = MODEL.field()
    dtype: str = option(
        "--dtype", "auto", choices=names.DTYPES, launch=True, chart="config.scheduler.dtype",
        help="weights and KV cache dtype (attention, softmax and sampling run in fp32); auto = on CUDA bfloat16 "
             "(compute capability >= 8.0) else float16; on CPU bfloat16 with AMX / AVX-512-BF16, else float32; "
             "float16 on CUDA only")
    max_running_requests: int = option("--max-running-requests", 64, check=AtLeast(1), launch=True,
                                       chart="config.scheduler.maxRunningRequests",
                                       help="request slots: requests decoded together at most")
    max_total_tokens: int | None = option(
        "--max-total-tokens", None, check=Above(0), mutex="kv-size", launch=True,
        chart="config.scheduler.maxTotalTokens",
        help="KV pool size in tokens (default: from --kv-cache-gib, else a share of the memory available)")
    # For SmolLM2-135M a token's K and V over 30 layers take 23 KiB in bf16 (46 KiB in fp32).
    kv_cache_gib: float | None = option(
        "--kv-cache-gib", None, check=Above(0), mutex="kv-size", launch=True, chart="config.scheduler.kvCacheGib",
        help="KV pool size in GiB (default: on CPU --kv-cache-mem-fraction of the memory available once the weights "
             "are loaded; on CUDA what --mem-fraction-static leaves). The pool is address space, committed as "
             "tokens are first written")
    kv_cache_mem_fraction: float = option(
        "--kv-cache-mem-fraction", 0.3, check=Fraction(), not_in_chart=EXTRA_ARGS,
        help="CPU, without either size: this fraction of the memory available (MemAvailable, capped by a cgroup "
             "limit) after the weights load")
    max_prefill_tokens: int = option("--max-prefill-tokens", 8192, not_in_chart=EXTRA_ARGS,
                                     help="token budget of one prefill batch")
    context_length: int | None = CONTEXT_LENGTH.field()
    seed: int | None = option("--seed", None, not_in_chart=EXTRA_ARGS,
                              help="seed of the shared generator for requests that give none (default: random)")
    chunked_prefill_size: int = option(
        "--chunked-prefill-size", 2048, launch=True, chart="config.scheduler.chunkedPrefillSize",
        help="most prompt tokens prefilled per step, mixed with running decodes (<= 0: no chunking)")
    disable_radix_cache: bool = option("--disable-radix-cache", False, chart="config.scheduler.disableRadixCache",
                                       help="run without the prefix (radix) cache")
    schedule_policy: str = option(
        "--schedule-policy", "fcfs", choices=names.SCHEDULE_POLICIES, launch=True,
        chart="config.scheduler.schedulePolicy",
        help="admission order: first come first served, longest cached prefix first, or by request priority "
             "(lower first; then arrival), retracting the lowest priority first under KV pressure")
    load_format: str = option(
        "--load-format", "auto", choices=names.LOAD_FORMATS,
        not_in_chart="random weights are for benchmarks, not for serving",
        help="auto = the safetensors; dummy = random weights of config.json's shapes (benchmarks)")
    attention_backend: str = option(
        "--attention-backend", "auto", choices=("auto", *names.ATTENTION_BACKENDS), launch=True,
        chart="config.scheduler.attentionBackend",
        help="auto = triton on CUDA devices, cpu (C kernels, built once with cc; torch when no C compiler is "
             "there) on CPU; torch = the reference; triton on CPU needs TRITON_INTERPRET=1 (tests)")
    device: str = option("--device", "auto", check=DEVICE, metavar="{auto,cpu,cuda,cuda:N}",
                         chart="config.scheduler.device",
                         help="where weights, KV cache and sampling live; auto = the first CUDA device torch sees, "
                              "else cpu")
    # SGLang's --mem-fraction-static.
    mem_fraction_static: float = option(
        "--mem-fraction-static", 0.85, check=Fraction(), not_in_chart=EXTRA_ARGS,
        help="CUDA, without either size: weights, KV pool and the activation/CUDA-graph reserve take this fraction "
             "of the device's memory")
    cuda_graph_max_bs: int = option("--cuda-graph-max-bs", 160, check=AtLeast(1), not_in_chart=EXTRA_ARGS,
                                    help="CUDA: decode batches up to this size replay CUDA graphs captured at start-up")
    disable_cuda_graph: bool = option("--disable-cuda-graph", False, launch=True, not_in_chart=EXTRA_ARGS,
                                      help="CUDA: run every decode step eagerly")
    # None: on for CUDA, off on the CPU (whose forward holds the planning thread).
    overlap_schedule: bool | None = option(
        "--disable-overlap-schedule", None, const=False, launch=True, not_in_chart=EXTRA_ARGS,
        help="CUDA: plan each step only after the previous one's sampled ids reach the host "
             "(overlap is off on the CPU, where the forward holds the planning thread)")
    grammar_backend: str = option(
        "--grammar-backend", "llguidance", choices=names.GRAMMAR_BACKENDS, launch=True,
        chart="config.scheduler.grammarBackend",
        help="constrained decoding engine (structured outputs, forced tool calls); its package must be installed")
    grammar_compile_timeout_s: float = option(
        "--grammar-compile-timeout", 5.0, check=Above(0), launch=True, not_in_chart=EXTRA_ARGS,
        help="seconds a constrained request waits for its grammar to compile, else INVALID_ARGUMENT")
    # layers.batch_invariant; the CPU default was measured within 10 % of off (Engine).
    deterministic_inference: bool | None = option(
        "--enable-deterministic-inference", None, negative="--disable-deterministic-inference", launch=True,
        chart="config.scheduler.deterministicInference",
        help="a request's tokens and logprobs do not depend on its batch, chunking or prefix-cache hits "
             "(batch-invariant attention and linears; cpu or triton attention backend). Default: on for bf16 on "
             "the CPU with the cpu backend, off elsewhere",
        negative_help="turn the default deterministic inference off")
    quantization: str | None = option(
        "--quantization", None, choices=names.QUANTIZATION_METHODS, launch=True, chart="config.scheduler.quantization",
        help="CPU with AVX-512-VNNI: quantize every linear and the LM head to per-channel int8 at load; int8 runs "
             "W8A8 or weight-only per shape and batch size, whichever measured faster; int8wo weight-only (closer "
             "to bf16). Default: the checkpoint's weights in --dtype")
    # Multi-LoRA (services/scheduler/lora): adapters in PEFT's format, chosen per request by model.
    lora_modules: tuple[str, ...] = option(
        "--lora-modules", (), metavar="NAME=PATH", launch=True,
        not_in_chart=f"{BY_CHART}: config.scheduler.loraAdapters (name and path each) and loraVolume",
        help="a LoRA adapter (a PEFT directory: adapter_config.json, adapter_model.safetensors) loaded at start "
             "and served as model NAME; repeat for several. POST /v1/load_lora_adapter loads more at run time")
    max_loras: int = option(
        "--max-loras", 4, check=AtLeast(0), launch=True, chart="config.scheduler.maxLoras",
        help="LoRA adapters resident at once (a load beyond it is refused); 0 turns LoRA off (the linears run "
             "unwrapped); LoRA is off with --quantization")
    max_lora_rank: int = option("--max-lora-rank", 64, check=AtLeast(1), launch=True,
                                chart="config.scheduler.maxLoraRank",
                                help="the largest LoRA rank (r) an adapter may have")
    # Speculative decoding: services/scheduler/speculative/ (defaults measured: bench/RESULTS.md).
    speculative_algorithm: str = option(
        "--speculative-algorithm", "none", choices=names.SPECULATIVE_ALGORITHMS, launch=True,
        not_in_chart=EXTRA_ARGS,
        help="propose draft tokens and verify them in one forward (greedy output unchanged, sampled output "
             "distributed as without): ngram = prompt lookup over the request's prompt and output; draft = a "
             "smaller model of the same vocabulary (--speculative-draft-model)")
    speculative_num_draft_tokens: int = option(
        "--speculative-num-draft-tokens", 8, launch=True, check=AtLeast(1), not_in_chart=EXTRA_ARGS,
        help="most draft tokens a request verifies per step (fewer where its acceptance is low)")
    speculative_ngram_min: int = option(
        "--speculative-ngram-min-match", 1, launch=True, check=AtLeast(1), not_in_chart=EXTRA_ARGS,
        help="ngram: the shortest tail of the sequence looked up in it")
    speculative_ngram_max: int = option(
        "--speculative-ngram-max-match", 4, launch=True, check=AtLeast(1), not_in_chart=EXTRA_ARGS,
        help="ngram: the longest tail looked up (the longest match found is used)")
    speculative_draft_model: Path | None = option(
        "--speculative-draft-model", None, launch=True, not_in_chart=EXTRA_ARGS,
        help="draft: the draft model's directory (config.json and safetensors, loaded with transformers; its "
             "vocabulary the served model's)")
    # Embedding requests (/v1/embeddings, the Embed RPC): services/scheduler/executor/pooling.py.
    embedding_pooling: str | None = option(
        "--embedding-pooling", None, choices=POOLING_MODES, launch=True, not_in_chart=EXTRA_ARGS,
        help="how an embedding pools the prompt's final hidden states: the last token's, their mean or the first "
             "token's. Default: the model's sentence-transformers config (modules.json, 1_Pooling/config.json), "
             "else last")
    embedding_normalize: bool | None = option(
        "--embedding-normalize", None, negative="--no-embedding-normalize", launch=True, not_in_chart=EXTRA_ARGS,
        help="L2-normalise embeddings. Default: as the model's sentence-transformers modules say (a Normalize "
             "module), else on",
        negative_help="return embeddings as pooled, not normalised")


@dataclass(frozen=True, kw_only=True)
class SchedulerOptions:
    """The service around the engine: where it listens, its detokenizer, limits, tensor parallelism."""

    engine: EngineOptions
    host: str = HOST.field()
    port: int = option("--port", 30020, not_in_chart=f"{BY_CHART}: ports.scheduler",
                       help="gRPC port (0 = any free port)")
    detokenizer: str = option("--detokenizer", "127.0.0.1:30030", help="detokenizer gRPC address host:port",
                              not_in_chart=f"{BY_CHART}: the pod's own detokenizer, 127.0.0.1:ports.detokenizer")
    instance_id: str = option("--instance-id", "scheduler-0", not_in_chart=INSTANCE_ID_BY_CHART,
                              help="this scheduler's name towards the tokenizers and in the logs")
    torch_threads: int | None = option(
        "--torch-threads", None,
        not_in_chart="the scheduler counts the pod's CPU limit itself; config.scheduler.extraArgs overrides it",
        help="default: the usable cores (CPU affinity, capped by a cgroup CPU limit), shared over the "
             "tensor-parallel ranks")
    max_queued_requests: int | None = option(
        "--max-queued-requests", None, check=AtLeast(0), launch=True, chart="config.scheduler.maxQueuedRequests",
        help="requests allowed to wait for a request slot; beyond it refuse with RESOURCE_EXHAUSTED (HTTP 429) "
             "(default: no limit)")
    grace_period_s: float = GRACE_PERIOD.field()
    watchdog_timeout_s: float | None = option(
        "--watchdog-timeout", None, launch=True, chart="config.scheduler.watchdogTimeout",
        help="health NOT_SERVING after this many seconds with work pending and no step finished (default: off)")
    max_queued_tokens: int | None = option(
        "--max-queued-tokens", None, check=Above(0), launch=True, chart="config.scheduler.maxQueuedTokens",
        help="prompt tokens of the requests held (waiting and running) plus the new one's; beyond it refuse with "
             "RESOURCE_EXHAUSTED (HTTP 429); a request is never refused on an idle scheduler (default: no limit)")
    transport: Transport = TRANSPORT.field()
    metrics_port: int | None = METRICS_PORT.field()
    served_model_name: str | None = SERVED_MODEL_NAME.field()
    internal_auth: InternalAuth = INTERNAL_AUTH.field()
    log_requests: bool = LOG_REQUESTS.field()
    tracing: TracingOptions = TracingOptions()
    tp_size: int = option("--tp-size", 1, check=AtLeast(1), chart="replica.tpSize",
                          help="tensor parallelism: ranks (processes, one device each) this replica is sharded over")
    dist_init_addr: str = option("--dist-init-addr", "127.0.0.1", launch=True, not_in_chart=TP_IN_POD,
                                 help="tensor parallelism: the address rank 0 hosts the group's rendezvous on")
    dist_port: int = option("--dist-port", 0, not_in_chart=TP_IN_POD,
                            help="tensor parallelism: the rendezvous port (0 = a free port)")
    dist_timeout_s: float = option(
        "--dist-timeout", 60.0, check=Above(0), not_in_chart=EXTRA_ARGS,
        help="tensor parallelism: seconds any collective waits for the other ranks before failing")
    # Prefill/decode disaggregation (docs/disaggregation.md); the launcher sets the mode per scheduler.
    disaggregation_mode: str = option(
        "--disaggregation-mode", "null", choices=("null", "prefill", "decode"),
        not_in_chart=f"{BY_CHART}: prefill and decode in the two replica sets of disaggregation.enabled",
        help="what this scheduler offers the tokenizers' routers: null = prefill and decode (a replica of its own); "
             "prefill = prompts, handing KV and first token to a decode scheduler; decode = the rest of requests "
             "a prefill scheduler started")
    disaggregation_transfer_timeout_s: float = option(
        "--disaggregation-transfer-timeout", 30.0, check=Above(0), launch=True, chart="disaggregation.transferTimeout",
        help="seconds each wait of a prefill-to-decode handoff (the reservation, a prompt chunk's KV transfer, the "
             "first token's commit) may take before the request ends with DEADLINE_EXCEEDED")
    disaggregation_transfer_backend: str = option(
        "--disaggregation-transfer-backend", "mooncake", choices=("grpc", "mooncake"), launch=True,
        chart="disaggregation.transferBackend",
        help="how a prefill scheduler moves KV rows into the decode scheduler's: mooncake = Mooncake's transfer "
             "engine writes them in place (TCP over host memory; a KV pool on a GPU moves through grpc instead); "
             "grpc = streamed through the decode scheduler's gRPC server. The decode side's choice rules")
