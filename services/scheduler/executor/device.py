"""Where the engine's tensors live: one ``DeviceRuntime`` per device kind, chosen once at start-up.

Every difference between running on the CPU and on a CUDA GPU is here, so neither ``engine/``
nor the layers hold ``if cuda`` branches: the engine asks the runtime, and the model builder
hands the layers what the runtime decided when they are built.

- the step's only host-to-device copy (``to_device``: pinned host memory, ``non_blocking``
  on CUDA; the identity on CPU) and its only device-to-host copy (``to_host``);
- the default dtype (CUDA: bfloat16 at compute capability >= 8.0, else float16; CPU:
  bfloat16 where the CPU multiplies it natively, else float32);
- how many bytes the KV pool may take (``kv_pool_bytes``): on CUDA the part of
  ``mem_fraction_static`` of the device's total memory left after the weights and an
  activation / CUDA-graph reserve (SGLang's ``--mem-fraction-static``); on CPU a fraction
  of the memory still available after the weights load;
- random-number generators on the device, for seeded requests;
- whether decode may run from CUDA graphs, and whether the host plans the next step while
  the device runs this one (overlap scheduling);
- defaults that depend on the device: the attention backend, deterministic inference;
- which kernels the layers run: oneDNN-packed bf16 linears and the int8 C linears (CPU),
  the Triton grouped-GEMM experts and batch-invariant GEMM (CUDA), or which attention
  backends can run here at all;
- whether the req-to-token table has a device copy, and the collectives' backend (gloo or
  NCCL, with the CUDA device made current).

Tests on machines without a GPU replace ``to_device`` / ``to_host`` (see
``tests/scheduler/test_device_placement.py``): under ``FakeTensorMode`` every device tensor
is a fake CUDA tensor, any CPU/CUDA mix raises and any data-dependent read (a host sync on
a real GPU) raises.

Rule for device-side code, which that test enforces: index device tensors with torch
functions (``narrow``, ``select``, ``index_select``, ``split``, ``unsqueeze``), never with
Python subscripts (``t[a:b]``, ``t[idx]``): on CUDA an index tensor built in a subscript
may be created on the host, and a CPU-only torch cannot run subscripts on (fake) CUDA
tensors at all.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from services.scheduler.policy.kv_pool import GIB, available_memory_bytes, kv_pool_tokens

if TYPE_CHECKING:
    from services.scheduler.attention.backends import AttentionBackend
    from services.scheduler.config import EngineConfig

log = logging.getLogger(__name__)

def resolve_device(name: str) -> torch.device:
    """``--device`` -> torch.device: "auto" is the first CUDA device when torch sees one, else the CPU.

    Raises:
        ValueError: a name other than auto, cpu, cuda or cuda:N.
        RuntimeError: a CUDA device asked for where torch has none (named, with the count seen).
    """
    if name == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from exc
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index or 0
        if index >= count:
            raise RuntimeError(f"--device {name}: torch sees {count} CUDA device(s)"
                               + ("" if torch.version.cuda else " (this torch is a CPU-only build)"))
        device = torch.device("cuda", index)
    return device


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Tensor-parallel rank ``rank``'s device: the CPU for every rank, or the ``rank``-th CUDA
    device from ``device`` on (``cuda:1`` with 4 ranks: cuda:1..cuda:4).

    Raises:
        RuntimeError: torch sees fewer CUDA devices than that.
    """
    if device.type != "cuda" or rank == 0:
        return device
    return resolve_device(f"cuda:{(device.index or 0) + rank}")


@dataclass(frozen=True)
class MemorySplit:
    """How the device's memory is shared out at start-up (bytes), logged and exported as metrics.

    Attributes:
        total: the device's memory (CPU: what was available before the KV pool).
        weights: the model's parameters and buffers.
        reserve: kept free for activations, logits and CUDA graphs (0 on CPU).
        kv_cache: the KV pool.
    """

    total: int
    weights: int
    reserve: int
    kv_cache: int

    def describe(self) -> str:
        return (f"weights {self.weights / GIB:.2f} GiB, KV cache {self.kv_cache / GIB:.2f} GiB, "
                f"reserve {self.reserve / GIB:.2f} GiB, of {self.total / GIB:.2f} GiB")


@functools.cache
def _cpu_argmax() -> Callable[[torch.Tensor], torch.Tensor]:
    from services.scheduler.kernels import cpu_kernels

    try:
        cpu_kernels.library()
    except cpu_kernels.KernelBuildError:
        return lambda x: x.argmax(dim=-1)
    return cpu_kernels.argmax


class DeviceRuntime:
    """The CPU runtime; ``CudaRuntime`` overrides what differs on a GPU.

    Args:
        device: where weights, KV pool, req-to-token table and sampling live.
    """

    supports_cuda_graph = False
    # The CPU forward holds the host thread: there is nothing to plan beside it.
    overlap_default = False
    # Host and device share memory: the req-to-token table is one tensor, never mirrored.
    mirrors_tables = False
    dist_backend = "gloo"
    default_attention_backend = "cpu"  # the C kernels (``create_attention_backend`` falls back to torch)
    # Deterministic inference's linears: "padded", probed and called only at row counts that
    # agree (``layers.batch_invariant.RowWindow``), or "triton": the fixed-tile GEMM.
    batch_invariant_linears = "padded"
    int8_linears = True  # ``--quantization``'s C kernels (the CPU's flags checked by ``layers.quant``)

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def kv_mem_fraction(self, cfg: EngineConfig) -> float:
        """The fraction of memory ``memory_split`` gives the KV pool by default: of the memory
        available once the weights are loaded (``--kv-cache-mem-fraction``)."""
        return cfg.kv_cache_mem_fraction

    def deterministic_default(self, dtype: torch.dtype, backend: AttentionBackend) -> bool:
        """Deterministic inference when not asked either way: on for a bf16 model with a
        batch-invariant attention backend (measured within 10 % of the default throughput,
        bench/RESULTS.md); fp32 pads small batches to 16-57 rows, so off."""
        return dtype == torch.bfloat16 and backend.batch_invariant

    @property
    def packs_linears(self) -> bool:
        """Whether bf16 linears are held in oneDNN's blocked layout (``layers.linear``): where
        this torch's oneDNN multiplies bf16."""
        from services.scheduler.layers.linear import onednn_bf16

        return onednn_bf16()

    def fused_experts(self):
        """The grouped-GEMM kernel MoE experts run through, or None: the CPU expert path
        (``layers.moe.fused_experts_cpu``)."""
        return None

    def attention_backend_refusal(self, name: str) -> str | None:
        """Why attention backend ``name`` cannot run here, or None. Triton runs on the CPU only
        in its interpreter (``TRITON_INTERPRET=1`` set before triton defines the kernels)."""
        if name != "triton":
            return None
        from services.scheduler.kernels import triton_attention  # the interpreter choice is made at import

        if triton_attention.interpreted():
            return None
        return (f"attention backend 'triton' on a {self.device.type} device needs Triton's interpreter: set "
                "TRITON_INTERPRET=1 in the environment before the process starts (it is read when triton "
                "defines the kernels), or use --attention-backend torch")

    def bind(self) -> None:
        """Make this device the process's current one (collectives run on it)."""

    def default_dtype(self) -> torch.dtype:
        """bfloat16 where the CPU multiplies it natively (AMX or AVX-512-BF16: ~4x fp32's
        matmul speed on these machines), else float32."""
        return torch.bfloat16 if cpu_has_bf16() else torch.float32

    def supported_dtypes(self) -> dict[str, torch.dtype]:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}

    def resolve_dtype(self, name: str) -> torch.dtype:
        """``--dtype`` -> torch dtype for this device ("auto" = ``default_dtype``).

        Raises:
            ValueError: a dtype this device does not run, naming the supported ones.
        """
        if name == "auto":
            return self.default_dtype()
        dtypes = self.supported_dtypes()
        if name not in dtypes:
            raise ValueError(f"dtype {name!r} is not supported on {self.device.type}; "
                             f"supported: auto, {', '.join(sorted(dtypes))}")
        return dtypes[name]

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """The step's host-to-device copy of ``host`` (the identity on CPU)."""
        return host

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """The step's device-to-host copy (the identity on CPU); blocks until ``t`` is computed."""
        return t

    def to_host_async(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start the device-to-host copy of ``t``; the returned function waits for it and
        returns the host tensor (on the CPU the copy is the identity, made when asked)."""
        return lambda: self.to_host(t)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(dim=-1)`` of a [B, V] fp32 batch (sampling's reduction over the vocabulary):
        on the CPU the C kernel (``kernels.cpu_kernels.argmax``: the same indices, 10x torch's
        speed), or torch's where the kernels do not build."""
        return _cpu_argmax()(x)

    def generator(self, seed: int | None) -> torch.Generator:
        """A generator on the device seeded with ``seed`` (None: a nondeterministic seed)."""
        gen = torch.Generator(self.device)
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        return gen

    def memory_split(self, weight_bytes: int, bytes_per_token: int, max_total_tokens: int | None,
                     kv_cache_gib: float | None, mem_fraction: float, reserve_bytes: int) -> tuple[int, MemorySplit]:
        """KV pool size in tokens and the memory split, from the first setting given:
        ``max_total_tokens``, ``kv_cache_gib``, else ``mem_fraction`` of the memory available
        now (the weights already loaded).

        Raises:
            ValueError: the pool would hold less than one token.
        """
        available = available_memory_bytes()
        tokens = kv_pool_tokens(bytes_per_token, max_total_tokens, kv_cache_gib,
                              int(mem_fraction * available),
                              f"--kv-cache-mem-fraction {mem_fraction:g} of {available / GIB:.2f} GiB available")
        return tokens, MemorySplit(available + weight_bytes, weight_bytes, 0, tokens * bytes_per_token)


class CudaRuntime(DeviceRuntime):
    """A CUDA device: pinned, non-blocking copies, bf16/fp16, memory sized from the device's total."""

    supports_cuda_graph = True
    overlap_default = True  # the device runs the forward while the host plans
    mirrors_tables = True
    dist_backend = "nccl"
    default_attention_backend = "triton"
    batch_invariant_linears = "triton"  # cuBLAS picks kernels by shape: the fixed-tile GEMM instead
    int8_linears = False

    def kv_mem_fraction(self, cfg: EngineConfig) -> float:
        """SGLang's ``--mem-fraction-static``: of the device's total memory (``memory_split``)."""
        return cfg.mem_fraction_static

    def deterministic_default(self, dtype: torch.dtype, backend: AttentionBackend) -> bool:
        """Off: cuBLAS is not batch-invariant, and the Triton GEMM that is costs throughput."""
        return False

    @property
    def packs_linears(self) -> bool:
        return False

    def fused_experts(self):
        """The Triton grouped GEMM (``kernels.triton_moe``)."""
        from services.scheduler.kernels import triton_moe  # triton only where it runs

        return triton_moe.fused_experts

    def attention_backend_refusal(self, name: str) -> str | None:
        """The cpu backend's C kernels read host memory."""
        return f"attention backend 'cpu' runs on the CPU, not on {self.device.type}" if name == "cpu" else None

    def bind(self) -> None:
        """NCCL needs the rank's device current."""
        torch.cuda.set_device(self.device)

    def default_dtype(self) -> torch.dtype:
        major, _ = torch.cuda.get_device_capability(self.device)
        return torch.bfloat16 if major >= 8 else torch.float16

    def supported_dtypes(self) -> dict[str, torch.dtype]:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.pin_memory().to(self.device, non_blocking=True)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu")

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)

    def to_host_async(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """A non-blocking copy into pinned memory and an event; waiting synchronizes on the
        event only, so the host can schedule the next step meanwhile."""
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def wait() -> torch.Tensor:
            done.synchronize()
            return host

        return wait

    def memory_split(self, weight_bytes, bytes_per_token, max_total_tokens, kv_cache_gib, mem_fraction,
                     reserve_bytes):
        """As ``DeviceRuntime.memory_split``, with the default size SGLang's: of
        ``mem_fraction`` x the device's total memory, what the weights (and anything else
        already on the device) and ``reserve_bytes`` leave."""
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(mem_fraction * total) - (total - free) - reserve_bytes
        tokens = kv_pool_tokens(bytes_per_token, max_total_tokens, kv_cache_gib, budget,
                              f"--mem-fraction-static {mem_fraction:g} of {total / GIB:.2f} GiB, "
                              f"{(total - free) / GIB:.2f} GiB in use, reserve {reserve_bytes / GIB:.2f} GiB")
        return tokens, MemorySplit(total, weight_bytes, reserve_bytes, tokens * bytes_per_token)


def create_runtime(device: torch.device) -> DeviceRuntime:
    """The runtime for ``device`` (a torch.device from ``resolve_device``)."""
    return CudaRuntime(device) if torch.device(device).type == "cuda" else DeviceRuntime(device)


def cpu_has_bf16() -> bool:
    """True when /proc/cpuinfo lists amx_bf16 or avx512_bf16 (False where it cannot be read)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " amx_bf16" in flags or " avx512_bf16" in flags
