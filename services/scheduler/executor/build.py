"""One builder of the model, its pools and its runner, for every tensor-parallel rank.

Rank 0 (``Engine``) and ranks > 0 (``executor.tp.worker_main``) build the same things in the
same order; only two decisions are rank 0's, and the other ranks take them from it
(``PoolShape``): how many tokens the KV pool holds (sized from the device's memory) and
whether deterministic inference is on.

1. ``load_engine_model``: the model's shard on this rank's device, quantized if asked.
2. ``size_pools`` (rank 0): the context length, the KV pool's size and the memory split.
3. ``build_stack``: bf16 linears packed for oneDNN, the linears made batch-invariant when
   deterministic inference is on, the KV pool and req-to-token table, the CUDA-graph runner
   where it can run, and the ``ModelRunner``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from services.scheduler.config import EngineConfig
from services.scheduler.executor.cuda_graph import DecodeGraphRunner
from services.scheduler.executor.device import DeviceRuntime, MemorySplit, create_runtime, rank_device, resolve_device
from services.scheduler.executor.model_runner import ModelRunner
from services.scheduler.layers.batch_invariant import NotBatchInvariantError, make_batch_invariant
from services.scheduler.layers.linear import pack_linears
from services.scheduler.layers.parallel import TensorParallel
from services.scheduler.layers.quant import (
    KERNELS,
    WEIGHT_ONLY,
    check_supported,
    choose_kernels,
    describe,
    fix_kernels,
    quantize_model,
)
from services.scheduler.lora.layers import LoraModel, attach_lora
from services.scheduler.models import load_model
from services.scheduler.models.base import CausalLM
from services.scheduler.models.config import ModelConfig
from services.scheduler.policy.kv_pool import GIB, ReqToTokenPool, TokenToKVPool

log = logging.getLogger(__name__)

# The default (bf16 on the CPU) turns deterministic inference on only where no linear pads a
# call of fewer rows than this: measured, a floor of 2 (one GEMM, AVX-512-BF16) keeps it
# within 10 % of the default arithmetic; a floor of 16 would cost a batch-1 step several times.
AUTO_MAX_FLOOR = 4


@dataclass(frozen=True)
class PoolShape:
    """What rank 0 decided and every rank's pools and linears must match."""

    max_total_tokens: int
    context_length: int
    max_running_requests: int
    deterministic: bool = False  # rank 0's resolved deterministic inference: every rank's linears batch-invariant


@dataclass
class ModelStack:
    """A rank's model with everything that runs it (``build_stack``)."""

    model: CausalLM
    runtime: DeviceRuntime
    shape: PoolShape
    kv_pool: TokenToKVPool
    req_pool: ReqToTokenPool
    runner: ModelRunner
    lora: LoraModel | None = None  # the adaptable linears (LoRA on: ``lora_enabled``)

    @property
    def tp(self) -> TensorParallel:
        return self.model.tp


def load_engine_model(cfg: EngineConfig, tp: TensorParallel | None = None) -> tuple[CausalLM, DeviceRuntime]:
    """Load ``cfg.model``'s shard of rank ``tp.rank`` onto its device (``executor.device.rank_device``)
    in ``cfg.dtype``, quantized as ``cfg.quantization`` says; returns it and the device's runtime.

    Raises:
        ValueError: unsupported architecture, device, dtype or attention backend, or a model
            ``tp.size`` does not divide.
        QuantizationError: a quantization this device or CPU cannot run (before the weights load).
        RuntimeError: a CUDA device torch does not see, or an attention backend that cannot
            run on the device.
        FileNotFoundError: missing config.json or weights.
    """
    tp = tp or TensorParallel()
    runtime = create_runtime(rank_device(resolve_device(cfg.device), tp.rank))
    if cfg.quantization:
        check_supported(cfg.quantization, runtime.device)  # before minutes of loading
    model = load_model(Path(cfg.model), runtime.resolve_dtype(cfg.dtype), cfg.load_format, cfg.attention_backend,
                       runtime, tp)
    apply_quantization(model, cfg)
    return model, runtime


def apply_quantization(model: CausalLM, cfg: EngineConfig) -> None:
    """``cfg.quantization``: quantize ``model``'s linears in place, choose each one's kernel
    per batch size from measurements (``layers.quant``) and let the model run each RMSNorm
    inside the int8 linear it feeds where its layers allow (``fuse_cpu_linears``); nothing
    when it is None.

    Raises:
        QuantizationError: a method, device or CPU ``layers.quant.check_supported`` refuses.
    """
    if not cfg.quantization:
        return
    quantize_model(model, cfg.quantization)
    choose_kernels(model, model.kv_shape().dtype, KERNELS if cfg.quantization == "int8" else WEIGHT_ONLY)
    fused = model.fuse_cpu_linears()
    log.info("--quantization %s: %s%s", cfg.quantization, describe(model),
             ", RMSNorm and SiLU-and-mul inside the int8 linears' calls" if fused else "")


def probe_rows(cfg: EngineConfig) -> int:
    """The largest row count a step's linears run, as far as the batch-invariance probe checks (<= 1024)."""
    return min(1024, *(n for n in (cfg.chunked_prefill_size, cfg.max_prefill_tokens) if n > 0))


def size_pools(model: CausalLM, cfg: EngineConfig, runtime: DeviceRuntime) -> tuple[PoolShape, MemorySplit]:
    """Rank 0's sizes: the context length and the KV pool's tokens (from ``cfg`` or the
    device's memory, ``DeviceRuntime.memory_split``), and how the memory is shared out.

    Raises:
        ValueError: ``cfg.context_length`` beyond the model's positions, or a pool of less than one token.
    """
    mc = model.config
    context_length = cfg.context_length or mc.max_position_embeddings
    if context_length > mc.max_position_embeddings:
        raise ValueError(f"--context-length {context_length} exceeds the model's "
                         f"max_position_embeddings {mc.max_position_embeddings}")
    kv = model.kv_shape()
    tokens, memory = runtime.memory_split(
        weight_bytes(model), kv.bytes_per_token(), cfg.max_total_tokens, cfg.kv_cache_gib,
        runtime.kv_mem_fraction(cfg),
        activation_reserve_bytes(mc, cfg, kv.dtype))
    log.info("KV pool: %d tokens of %s on %s; memory: %s", tokens, kv.dtype, runtime.device, memory.describe())
    return PoolShape(tokens, context_length, cfg.max_running_requests), memory


def build_stack(model: CausalLM, cfg: EngineConfig, runtime: DeviceRuntime, shape: PoolShape,
                resolve_deterministic: bool = False) -> ModelStack:
    """Pack the bf16 linears (``layers.linear``), make the model batch-invariant when
    ``shape.deterministic`` (or, with ``resolve_deterministic``, when ``cfg`` and the device
    say so: rank 0's decision, returned in the stack's shape), then build the pools of
    ``shape``, the CUDA-graph runner (one rank, a device and backend that capture, not
    disabled) and the model runner.

    Raises:
        ValueError, NotBatchInvariantError: see ``make_deterministic``.
    """
    lora = attach_lora(model) if lora_enabled(cfg) else None  # before packing replaces the linears
    if runtime.packs_linears:
        pack_linears(model)
    if resolve_deterministic:
        shape = replace(shape, deterministic=make_deterministic(model, cfg, runtime))
    elif shape.deterministic:
        make_deterministic(model, replace(cfg, deterministic_inference=True), runtime)
    if runtime.packs_linears:  # bf16 on AMX: the layers' linears are the C library's (LoRA's first
        model.fuse_cpu_linears()  # adapter wraps them, and undoes this: lora.layers.LoraModel.add)
    tp = model.tp
    kv = model.kv_shape()
    kv_pool = TokenToKVPool(shape.max_total_tokens, kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype,
                            runtime.device)
    req_pool = ReqToTokenPool(shape.max_running_requests, shape.context_length, runtime.device, kv_pool.pad_row,
                              record_writes=tp.size > 1 and tp.rank == 0, mirrored=runtime.mirrors_tables)
    graphs = None
    if runtime.supports_cuda_graph and not cfg.disable_cuda_graph and tp.size == 1:
        graphs = DecodeGraphRunner(model, runtime, req_pool, kv_pool,
                                   min(cfg.cuda_graph_max_bs, shape.max_running_requests), capture=True)
    runner = ModelRunner(model, req_pool, kv_pool, runtime, graphs, batch_invariant=shape.deterministic,
                         lora=lora.batch if lora is not None else None)
    return ModelStack(model, runtime, shape, kv_pool, req_pool, runner, lora)


def lora_enabled(cfg: EngineConfig) -> bool:
    """LoRA adapters can be served: ``--max-loras`` above 0 and no ``--quantization`` (an int8
    linear has no parallel layout to shard an adapter by).

    Raises:
        ValueError: ``--lora-modules`` given where LoRA is off.
    """
    on = cfg.max_loras > 0 and not cfg.quantization
    if cfg.lora_modules and not on:
        raise ValueError("--lora-modules needs --max-loras above 0 and no --quantization")
    return on


def make_deterministic(model: CausalLM, cfg: EngineConfig, runtime: DeviceRuntime) -> bool:
    """Resolve ``cfg.deterministic_inference`` and, when on, make the forward batch-invariant:
    the attention backend must be, and the linears are probed (packed first, as
    ``build_stack`` packs them, so the probe measures the call the forward makes) and called
    only at the row counts measured to give a row the same bits (``layers.batch_invariant``).

    None (the default) turns it on where the runtime says (``DeviceRuntime.deterministic_default``:
    a bf16 model on the CPU with the cpu attention backend, measured within 10 % of the
    default throughput), unless the probe finds the CPU's GEMM not batch-invariant or a
    linear would pad calls of fewer than ``AUTO_MAX_FLOOR`` rows (then off, with a warning).

    Returns:
        Whether deterministic inference is on.

    Raises:
        ValueError: asked for (True) with an attention backend that is not batch-invariant (torch).
        NotBatchInvariantError: asked for, and a linear's GEMM has no batch-invariant row window here.
    """
    backend = model.attn_backend
    asked = cfg.deterministic_inference
    if asked is None:
        dtype = model.kv_shape().dtype
        if not runtime.deterministic_default(dtype, backend):
            log.info("deterministic inference off (the default for %s on %s with the %s attention backend; "
                     "--enable-deterministic-inference to turn it on)", str(dtype).removeprefix("torch."),
                     runtime.device.type, backend.name)
            return False
    elif not asked:
        log.info("deterministic inference off (--disable-deterministic-inference)")
        return False
    elif not backend.batch_invariant:
        raise ValueError(f"--enable-deterministic-inference needs a batch-invariant attention backend (cpu or "
                         f"triton), not {backend.name!r}: its SDPA and batched matmuls reduce in a "
                         "batch-dependent order")
    if runtime.packs_linears:  # as build_stack packs them, so the probe measures the call the forward makes
        pack_linears(model)
    try:
        wrapped = make_batch_invariant(model, max_rows=probe_rows(cfg), kernels=runtime.batch_invariant_linears,
                                       max_floor=None if asked else AUTO_MAX_FLOOR)
    except NotBatchInvariantError as exc:
        if asked:
            raise
        log.warning("deterministic inference off: %s", exc)
        return False
    pinned = fix_kernels(model)  # int8 linears mixing W8A8 and weight-only: one kernel, whatever the batch
    tp: TensorParallel = model.tp
    if tp.size > 1:
        tp.fixed_order = True  # every layer holds this one object
    log.info("deterministic inference on: extend attention through the %s decode kernel, %d linears at measured "
             "row counts%s%s", backend.name, len(wrapped), ", all-reduce in rank order" if tp.size > 1 else "",
             f", {pinned} int8 linears pinned to one kernel ({describe(model)})" if pinned else "")
    return True


def weight_bytes(model: CausalLM) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied
    embeddings share one: two Parameters over the same storage)."""
    storages = {}
    for t in list(model.parameters()) + list(model.buffers()):
        storage = t.untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def activation_reserve_bytes(mc: ModelConfig, cfg: EngineConfig, dtype: torch.dtype) -> int:
    """Device memory kept out of the KV pool for one step's activations, its logits and
    sampling, and the CUDA graphs (bytes). An estimate from the shapes: a step's tokens
    (``min(max_prefill_tokens, chunked_prefill_size)`` plus a decode row per running
    request) times one layer's widest activations (q/k/v, the MLP's widest:
    ``ModelConfig.mlp_activation_width``, a MoE layer's from its experts' intermediate size,
    and four hidden-size tensors) twice over, float32 logits of every running request four
    times over (softmax, sort, filters), plus 512 MiB for the graphs' pool and the
    allocator's slack. Only the CUDA runtime uses it."""
    chunk = cfg.max_prefill_tokens if cfg.chunked_prefill_size <= 0 else min(cfg.max_prefill_tokens,
                                                                                cfg.chunked_prefill_size)
    tokens = chunk + cfg.max_running_requests
    width = (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim + mc.mlp_activation_width() \
        + 4 * mc.hidden_size
    logits = 4 * cfg.max_running_requests * mc.vocab_size * 4
    return 2 * tokens * width * dtype.itemsize + logits + GIB // 2
