"""Linears run by the C library's ``rs_int8_linear`` (``kernels/cpu/int8.c``): the int8 linears
of ``layers.quant`` and, on CPUs with AMX-BF16, the bf16 linears (``AmxBf16Linear``).

``CpuLinear`` is what they share: packed weights in buffers (``packed``, ``scale``, ``comp``,
``bias``), the kernel per row count (``kernels``, ``kernel_for``), a call that may compute its
input's producer in the same C call (RMSNorm with the residual add, or SiLU-and-mul), and the
weights' addresses found once. ``models.layer_stack`` runs a step's layers of these in one C call.

``AmxBf16Linear``, why: oneDNN's bf16 GEMM at one row read SmolLM2's weights at ~7 GB/s a core
(a batch-1 step 36-48 ms against a 13-15 ms floor of the bytes), and oneDNN windows the row
counts for batch invariance (``layers.batch_invariant``). On the tiles (``rs_bf16_amx_blocks``,
``kernels/cpu/amx.c``) from weights packed once in the B tile layout, one kernel runs every row
count, and a row's sums do not depend on the batch: batch-invariant by construction, no window.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from services.scheduler.kernels.cpu_kernels import KernelBuildError, cpu_flags, library

log = logging.getLogger(__name__)

BF16_AMX_KERNEL = 4  # rs_int8_linear's id of the bf16-weights-on-AMX kernel
AMX_K = 32  # a tile's k step in bf16 elements: in_features must be a multiple of it


@functools.cache
def lib() -> ctypes.CDLL:
    """The kernel library with the linears' entry points typed."""
    out = library()
    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ("rs_int8_available", "rs_w8_bf16_available", "rs_w8_amx_available", "rs_w8a8_amx_available"):
        getattr(out, name).argtypes, getattr(out, name).restype = [], ctypes.c_int
    out.rs_int8_linear.argtypes = [i, i, p, p, p, ctypes.c_float, i64, i64, i64, p, p, p, p, p, i64, i, i]
    out.rs_int8_linear.restype = None
    return out


class CpuLinear(torch.nn.Module):
    """``y = x @ W^T + b`` through ``rs_int8_linear``; subclasses pack the weights and name the kernels.

    Attributes:
        kernels: ((min_rows, kernel), ...) ascending; a call of T rows runs the kernel of the
            largest min_rows <= T.
        out_dtype: None: x's; float32 for an int8 LM head (``layers.quant.quantize_model``).
    """

    kernels: tuple[tuple[int, str], ...]
    out_dtype: torch.dtype | None = None
    in_features: int
    out_features: int
    k_padded: int

    def kernel_for(self, rows: int) -> str:
        """The kernel a call of ``rows`` rows runs."""
        chosen = self.kernels[0][1]
        for min_rows, kernel in self.kernels:
            if rows >= min_rows:
                chosen = kernel
        return chosen

    def kernel_id(self, kernel: str, dtype: torch.dtype) -> int:
        """``rs_int8_linear``'s id of ``kernel`` on ``dtype`` activations."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, kernel: str | None = None, norm: tuple | None = None,
                silu_and_mul: bool = False) -> torch.Tensor:
        """x: [T, in_features] bf16 or fp32 -> [T, out_features] in x's dtype (or ``out_dtype``).

        Args:
            kernel: the kernel to run (default: ``kernel_for(T)``).
            norm: (weight [in_features], eps, residual [T, in_features] or None): the input is
                ``add_rms_norm(x, weight, eps, residual)`` (``kernels.cpu_kernels``; the
                residual updated in place), computed in the same C call.
            silu_and_mul: x is gate_up [T, 2 * in_features] and the input is SiLU(gate) * up,
                in the same C call.

        Raises:
            ValueError: x not 2-D with in_features (2 x with ``silu_and_mul``) columns, or a
                dtype the kernel does not take.
        """
        width = 2 * self.in_features if silu_and_mul else self.in_features
        if x.dim() != 2 or x.shape[1] != width:
            raise ValueError(f"{type(self).__name__} takes [T, {width}], got {list(x.shape)}")
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{type(self).__name__} takes bf16 or fp32 activations, got {x.dtype}")
        x = x.contiguous()
        t = x.shape[0]
        out = torch.empty(t, self.out_features, dtype=self.out_dtype or x.dtype)
        if t == 0:
            return out
        kernel_id = self.kernel_id(kernel or self.kernel_for(t), x.dtype)
        pre, weight, eps, residual = 0, None, 0.0, None
        if norm is not None:
            pre, (weight, eps, residual) = 1, norm
            weight = weight.data_ptr()
            residual = None if residual is None else residual.data_ptr()
        elif silu_and_mul:
            pre = 2
        packed, scale, comp, bias = self.weight_ptrs()
        lib().rs_int8_linear(kernel_id, pre, x.data_ptr(), residual, weight, eps, t, self.in_features, self.k_padded,
                             packed, scale, comp, bias, out.data_ptr(), self.out_features,
                             int(x.dtype == torch.bfloat16), int(out.dtype == torch.bfloat16))
        return out

    # The weights' addresses, found once: a module's buffer lookup and data_ptr() were a fifth of
    # a call's Python time, ~120 calls a step. Whatever may move a buffer forgets them.
    _weight_ptrs: tuple[int, int | None, int | None, int | None] | None = None

    def weight_ptrs(self) -> tuple[int, int | None, int | None, int | None]:
        """The addresses of ``packed``, ``scale``, ``comp`` and ``bias`` (None: absent), as
        ``rs_int8_linear`` takes them."""
        if self._weight_ptrs is None:
            def ptr(name: str) -> int | None:
                t = getattr(self, name)
                return None if t is None else t.data_ptr()

            self._weight_ptrs = (self.packed.data_ptr(), ptr("scale"), ptr("comp"), ptr("bias"))
        return self._weight_ptrs

    def _apply(self, fn, recurse=True):
        self._weight_ptrs = None
        return super()._apply(fn, recurse)

    def __setattr__(self, name: str, value) -> None:
        if name in ("packed", "scale", "comp", "bias"):
            self.__dict__["_weight_ptrs"] = None
        super().__setattr__(name, value)


@functools.cache
def amx_bf16_available() -> bool:
    """Whether this CPU and the built library run ``AmxBf16Linear`` (AMX-BF16 with the process's
    permission for the tile data, and the library's AVX-512 int8 path that calls it). False,
    without building anything, on a CPU without ``amx_bf16``, and where the library does not
    build (bf16 then stays on oneDNN, as the cpu attention backend falls back to torch)."""
    if "amx_bf16" not in cpu_flags().split():
        return False
    try:
        return bool(lib().rs_int8_available()) and bool(lib().rs_w8_amx_available())
    except KernelBuildError as exc:
        log.warning("bf16 linears on oneDNN: the C kernels did not build (%s)", exc)
        return False


def can_run_amx_bf16(weight: torch.Tensor) -> bool:
    """A bf16 CPU weight whose in_features the tiles take, on a CPU that runs them."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.shape[1] % AMX_K == 0
            and amx_bf16_available())


def pack_amx_bf16(weight: torch.Tensor) -> torch.Tensor:
    """bf16 [N, K] -> the B tile layout of ``rs_bf16_amx_blocks``: [Np / 16, K / 2, 16, 2] (Np: N
    rounded up to 16, the padding channels zero): block b's k-pair row r holds channel 16 b + j's
    inputs 2r, 2r + 1 at [b, r, j]."""
    n, k = weight.shape
    np_ = -(-n // 16) * 16
    w = torch.zeros(np_, k, dtype=torch.bfloat16)
    w[:n] = weight.detach()
    return w.view(np_ // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


class AmxBf16Linear(CpuLinear):
    """A bf16 linear on AMX-BF16 tiles (see the module docstring): bf16 activations, any row count.

    Args:
        weight: bf16 [out_features, in_features], in_features a multiple of 32 (``can_run_amx_bf16``);
            copied into the tile layout, so the caller drops the module that held it.
        bias: [out_features] or None; kept in fp32 (added to the fp32 sums before the rounding).

    Raises:
        ValueError: a weight or CPU ``can_run_amx_bf16`` refuses.
    """

    kernels = ((1, "bf16amx"),)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        # Asks the kernel for the tile data first: without that permission a tile op is SIGILL.
        if not can_run_amx_bf16(weight):
            raise ValueError(f"AmxBf16Linear needs a bf16 CPU weight with in_features a multiple of {AMX_K} on a "
                             f"CPU with AMX-BF16, got {weight.dtype} {list(weight.shape)} on {weight.device} "
                             f"(AMX-BF16 {'available' if amx_bf16_available() else 'not available'})")
        self.out_features, self.in_features = weight.shape
        self.k_padded = self.in_features
        self.register_buffer("packed", pack_amx_bf16(weight))
        self.register_buffer("scale", None)
        self.register_buffer("comp", None)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def kernel_id(self, kernel: str, dtype: torch.dtype) -> int:
        if kernel != "bf16amx" or dtype != torch.bfloat16:
            raise ValueError(f"AmxBf16Linear runs kernel 'bf16amx' on bf16 activations, not {kernel!r} on {dtype}")
        return BF16_AMX_KERNEL
