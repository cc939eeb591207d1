"""Batch-invariant linear layers: a token's matmul rows do not depend on how many rows share the call.

Deterministic inference (``EngineConfig.deterministic_inference``) needs every op of the
forward to give a token the same bits whether the step holds 1 row or 300, whether the
token is prefilled, decoded, cached or chunked (He et al., "Defeating Nondeterminism in
LLM Inference", Thinking Machines 2025: batch invariance of matmuls, attention and
reductions). Attention is made so by the backends (``AttnMetadata``); the element-wise
and per-row kernels (RMSNorm, SiLU-and-mul, rotary, log-softmax) reduce each row alone
already. What remains is the GEMM: a BLAS may pick another kernel, blocking or
reduction split for another row count M, which changes the order of a row's fp32 sum.

Which row counts a GEMM library keeps invariant is a property of the library, the shape,
the dtype, the CPU and the thread count, not of the weights' values, so it is measured:
``probe`` runs random weights of each linear's shape through the same call the model
makes, at a ladder of row counts (1-9, then 2^k - 1, 2^k, 2^k + 1 up to ``max_rows``)
and at shifted row offsets, and compares every row to the same row of one large call.
Measured on AVX-512-BF16 (no AMX), 1 and 2 threads: oneDNN's bf16 GEMM computes one row
(M = 1) of a [576, 1536] weight in another order than any M >= 2, so that linear is padded
to 2 rows; its other SmolLM2 shapes agree at every count. MKL's fp32 GEMM gives rows
other bits up to M = 9 (2 threads), so fp32 linears are padded to 15 rows, which costs a
batch-1 step; that is why fp32 does not default to deterministic inference. When no floor
up to ``MAX_PAD_ROWS`` works the probe raises rather than run a mode that would be
deterministic only by luck.
"""

from __future__ import annotations

import functools
import hashlib
import logging

import torch
import torch.nn.functional as F

from services.scheduler.layers.cpu_kernels import cache_dir, cpu_flags, load_json, save_json
from services.scheduler.layers.linear import PackedLinear

log = logging.getLogger(__name__)

# Row counts probed: the small ones a decode step or a cache hit runs, then each side of
# the powers of two where a GEMM library switches blocking.
LADDER = (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 513)
MAX_PAD_ROWS = 64  # a floor above this costs more than a decode step is worth: refuse instead


class NotBatchInvariantError(RuntimeError):
    """A linear's GEMM gives a row different bits at different row counts, for every floor up to ``MAX_PAD_ROWS``."""


class RowPaddedLinear(torch.nn.Module):
    """``inner`` computed on at least ``min_rows`` rows: fewer are zero-padded, so the GEMM
    library runs the kernel it runs for every larger row count (see ``probe``).

    Args:
        inner: a linear module mapping [T, in_features] -> [T, out_features].
        min_rows: the floor ``probe`` measured.
    """

    def __init__(self, inner: torch.nn.Module, min_rows: int):
        super().__init__()
        self.inner = inner
        self.min_rows = min_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] -> [T, out_features], row t the same bits for every T."""
        t = x.shape[0]
        if t >= self.min_rows:
            return self.inner(x)
        return self.inner(F.pad(x, (0, 0, 0, self.min_rows - t))).narrow(0, 0, t)


def _call(linear: torch.nn.Module):
    """The call the model makes for ``linear`` (a packed oneDNN bf16 linear, or ``F.linear``)."""
    if isinstance(linear, PackedLinear):
        return linear
    return lambda x: F.linear(x, linear.weight, linear.bias)


def _probe_cache_path():
    """Where CPU probe results persist: one JSON file per torch build and CPU (the GEMM
    library and its kernels), under the kernel cache (``layers.cpu_kernels.cache_dir``)."""
    key = hashlib.sha256("\0".join([torch.__version__, str(torch.backends.mkldnn.is_available()),
                                     cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir() / f"batch-invariance-{key}.json"


@functools.cache
def probe(in_features: int, out_features: int, dtype: torch.dtype, device: str, packed: bool, threads: int,
          max_rows: int) -> int:
    """``measure``, remembered: in this process, and for the CPU in a JSON file beside the
    built kernels (``_probe_cache_path``), so a restarted scheduler does not measure again
    (a bf16 SmolLM2 takes ~6 s, mostly oneDNN compiling a kernel per row count). Same
    arguments, result and errors as ``measure``."""
    if device != "cpu":
        return measure(in_features, out_features, dtype, device, packed, threads, max_rows)
    path = _probe_cache_path()
    key = f"{in_features}x{out_features} {dtype} packed={packed} threads={threads} rows={max_rows}"
    known = load_json(path)
    if key not in known:
        try:
            known[key] = measure(in_features, out_features, dtype, device, packed, threads, max_rows)
        except NotBatchInvariantError as exc:
            known[key] = str(exc)
        save_json(path, known, "batch-invariance probe")
    if isinstance(known[key], str):
        raise NotBatchInvariantError(known[key])
    return int(known[key])


def measure(in_features: int, out_features: int, dtype: torch.dtype, device: str, packed: bool, threads: int,
            max_rows: int) -> int:
    """The least row count from which a linear of this shape is batch-invariant.

    Args:
        in_features, out_features, dtype, device: the weight's shape and placement.
        packed: the weight is oneDNN-packed (``layers.linear.PackedLinear``).
        threads: torch's intra-op thread count (part of the cache key: the split changes with it).
        max_rows: the largest row count compared; at every ``LADDER`` count m below it, the
            first max(64, 2m) rows (in calls of m rows) and m rows at another offset are
            compared with one ``max_rows`` call (and that call with its rows reversed, so
            every row is also computed at another position).

    Returns:
        1 when every row count agrees, else the floor to pad to (a ``LADDER`` value).

    Raises:
        NotBatchInvariantError: rows disagree above every floor up to ``MAX_PAD_ROWS``.
    """
    gen = torch.Generator(device).manual_seed(0)
    dev = torch.device(device)
    lin = torch.nn.Linear(in_features, out_features, bias=False, device=dev, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_features, in_features, generator=gen, device=dev))
    fn = _call(PackedLinear(lin) if packed else lin)
    # Inputs spread over 2^-12..2^12 against unit weights: large partial sums that cancel, so
    # a change of summation order changes the rounded result often (a fifth of the rows of a
    # [576, 1536] bf16 GEMM at one row against many), not once in hundreds as with N(0, 1).
    scale = torch.exp2(torch.randint(-12, 13, (max_rows, in_features), generator=gen, device=dev).float())
    x = (torch.randn(max_rows, in_features, generator=gen, device=dev) * scale).to(dtype)
    with torch.inference_mode():
        ref = fn(x)
        agree = {max_rows: torch.equal(fn(x.flip(0)), ref.flip(0))}
        for m in (m for m in LADDER if m < max_rows):
            tested = min(max_rows, max(64, 2 * m))  # rows compared at this count, in consecutive calls
            shift = (7 * m) % (max_rows - m + 1)  # and once at another offset
            agree[m] = all(torch.equal(fn(x.narrow(0, j, m)), ref.narrow(0, j, m))
                           for j in [*range(0, tested - m + 1, m), shift])
    floor = None
    for m in sorted(agree, reverse=True):
        if not agree[m]:
            break
        floor = m
    if floor is None or floor > MAX_PAD_ROWS:
        bad = sorted(m for m, ok in agree.items() if not ok)
        raise NotBatchInvariantError(
            f"a [{out_features}, {in_features}] {dtype} linear on {device} ({threads} threads) gives a row other bits "
            f"at row counts {bad} than at {max_rows}: deterministic inference cannot run on this GEMM library and CPU")
    return floor


def _use_triton(model: torch.nn.Module) -> dict[str, int]:
    """CUDA: every linear and RMSNorm through the fixed-tile Triton kernels (``layers.triton_batch_invariant``)."""
    from services.scheduler.layers import triton_batch_invariant as tbi  # triton only where it runs
    from services.scheduler.layers.norm import RMSNorm

    swapped: dict[str, int] = {}
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, tbi.TritonLinear(child))
            elif type(child) is RMSNorm:
                setattr(parent, name, tbi.TritonRMSNorm.of(child))
            else:
                continue
            swapped[f"{parent_name}.{name}".lstrip(".")] = 1
    return swapped


def make_batch_invariant(model: torch.nn.Module, max_rows: int = 1024, kernels: str = "padded") -> dict[str, int]:
    """Make ``model``'s linears batch-invariant, in place; idempotent.

    ``kernels`` "padded" (the CPU's, ``DeviceRuntime.batch_invariant_linears``): each linear
    whose GEMM is not batch-invariant at small row counts is wrapped in a ``RowPaddedLinear``
    (a wrapped linear is not probed again). "triton" (CUDA's): every linear and ``RMSNorm``
    runs through the fixed-tile Triton kernels instead (``layers.triton_batch_invariant``:
    cuBLAS and torch's reductions choose their strategy by shape), with no probe.

    Args:
        max_rows: the largest row count probed (``probe``); the LM head is probed to 128,
            as it runs only on the rows that sample (and on a chunk's prompt-logprob rows).

    Returns:
        {module name: floor} of the modules wrapped or replaced now (floor 1 for the Triton
        ones; empty when every CPU GEMM is invariant).

    Raises:
        NotBatchInvariantError: see ``probe``.
    """
    if kernels == "triton":
        return _use_triton(model)
    wrapped: dict[str, int] = {}
    threads = torch.get_num_threads()
    for parent_name, parent in list(model.named_modules()):
        if isinstance(parent, RowPaddedLinear):
            continue
        for name, child in list(parent.named_children()):
            if not isinstance(child, (torch.nn.Linear, PackedLinear)):
                continue
            packed = isinstance(child, PackedLinear)  # oneDNN-packed: bf16 on the CPU
            dtype, device = (torch.bfloat16, "cpu") if packed else (child.weight.dtype, child.weight.device.type)
            rows = min(128, max_rows) if name == "lm_head" else max_rows
            floor = probe(child.in_features, child.out_features, dtype, device, packed, threads, rows)
            if floor > 1:
                setattr(parent, name, RowPaddedLinear(child, floor))
                wrapped[f"{parent_name}.{name}".lstrip(".")] = floor
        if callable(getattr(parent, "linear_shapes", None)) and parent.min_rows == 1:
            # Stacked MoE experts (``layers.moe.Experts``): one floor for all of a layer's expert matmuls.
            packed = parent.packed is not None
            dtype = torch.bfloat16 if packed else parent.gate_up.dtype
            floor = max(probe(i, o, dtype, "cpu", packed, threads, max_rows) for i, o in parent.linear_shapes())
            if floor > 1:
                parent.min_rows = floor
                wrapped[parent_name] = floor
    if wrapped:
        log.info("deterministic inference: %d linears padded to a row floor (%s)", len(wrapped),
                 ", ".join(sorted({f"{f} rows" for f in wrapped.values()})))
    return wrapped

