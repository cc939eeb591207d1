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
the dtype, the CPU and the thread count, not of the weights' values, so it is measured, and
the linear is then only ever called with row counts that were measured to agree: a
``RowWindow``. ``probe`` runs random weights of each linear's shape through the same call the
model makes and compares every row, at two row offsets, with the same row of one call of
``cap`` rows: every count from 1 to ``EXACT_ROWS`` (the decode batches), then each power of
two up to ``cap``. The window is the counts from ``floor`` up that agree: a call of fewer
rows is zero-padded to ``floor``, one of up to ``EXACT_ROWS`` rows runs as it is, a larger
one is padded to the next power of two, and one of more than ``cap`` rows is split into
calls of ``cap`` rows. ``cap`` is the largest power of two from 256 down to ``MIN_CAP``
whose window has a floor up to ``MAX_PAD_ROWS``; at ``MIN_CAP`` the window may be the one
count ``cap``, which no GEMM library can make disagree with itself.

Why every count and not a ladder of them: measured on a Xeon with AMX (2 threads), oneDNN's
bf16 GEMM of a [576, 1536] weight gives a row other bits at 150, 160, 182 and 193-256 rows
than at 1024 or at 1-149, and MKL's fp32 GEMM of that shape disagrees at 1-15, 57-81, ...,
173-192 rows; a probe of 2^k - 1, 2^k, 2^k + 1 saw two of those counts. On AVX-512-BF16
without AMX (1 and 2 threads), oneDNN's bf16 GEMM computes one row of that weight in another
order than any M >= 2 (floor 2), and MKL's fp32 GEMM disagrees up to M = 9; fp32 windows
start at 10-57 rows, which costs a batch-1 step: that is why fp32 does not default to
deterministic inference. Only a GEMM that gives a row other bits at another position of the
same call is refused: the probe raises rather than run a mode that would be deterministic
only by luck.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.scheduler.kernels.cpu_kernels import cache_dir, cpu_flags, load_json, save_json
from services.scheduler.layers.linear import PackedLinear

log = logging.getLogger(__name__)

EXACT_ROWS = 64  # calls of up to this many rows (decode batches) run unpadded: each count is probed
MAX_CAP = 256  # the largest call: prefill chunks above it run in calls of this many rows
MIN_CAP = 32  # the smallest cap tried: a prefill in calls of fewer rows would read the weights too often
MAX_PAD_ROWS = 64  # a floor above this costs more than a decode step is worth: a smaller cap is tried
PROBE_VERSION = 2  # part of the cache key: results of another probe are not reused


class NotBatchInvariantError(RuntimeError):
    """A linear's GEMM gives a row different bits at different row counts, in every window (see ``measure``)."""


@dataclass(frozen=True)
class RowWindow:
    """The row counts a linear is called with so that each row gets the same bits.

    Attributes:
        floor: a call of fewer rows is zero-padded to this many.
        cap: a power of two; a call of more rows runs as calls of ``cap`` rows and a rest.
    """

    floor: int
    cap: int

    def call_rows(self, rows: int) -> int:
        """The padded row count of a call of ``rows`` <= ``cap`` rows."""
        if rows <= self.floor:
            return self.floor
        if rows <= EXACT_ROWS:
            return rows
        return min(self.cap, 1 << (rows - 1).bit_length())

    def counts(self) -> list[int]:
        """Every row count a call is made with (what ``measure`` checks)."""
        return sorted({self.call_rows(m) for m in range(1, self.cap + 1)})

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``fn`` over x: [T, in] -> [T, out], in calls whose row counts are in the window."""
        t = x.shape[0]
        if t <= self.cap and self.call_rows(t) == t:
            return fn(x)
        outs = []
        for start in range(0, t, self.cap):
            part = x.narrow(0, start, min(self.cap, t - start))
            rows = part.shape[0]
            padded = self.call_rows(rows)
            outs.append(fn(part) if padded == rows else fn(F.pad(part, (0, 0, 0, padded - rows))).narrow(0, 0, rows))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class RowPaddedLinear(torch.nn.Module):
    """``inner`` called only with the row counts of ``window`` (zero-padded or split, see
    ``RowWindow``), so the GEMM library gives a row the same bits in every call.

    Args:
        inner: a linear module mapping [T, in_features] -> [T, out_features].
        window: the window ``probe`` measured.
    """

    def __init__(self, inner: torch.nn.Module, window: RowWindow):
        super().__init__()
        self.inner = inner
        self.window = window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, in_features] -> [T, out_features], row t the same bits for every T."""
        return self.window.apply(self.inner, x)


def _call(linear: torch.nn.Module):
    """The call the model makes for ``linear`` (a packed oneDNN bf16 linear, or ``F.linear``)."""
    if isinstance(linear, PackedLinear):
        return linear
    return lambda x: F.linear(x, linear.weight, linear.bias)


def _probe_cache_path():
    """Where CPU probe results persist: one JSON file per torch build and CPU (the GEMM
    library and its kernels), under the kernel cache (``kernels.cpu_kernels.cache_dir``)."""
    key = hashlib.sha256("\0".join([torch.__version__, str(torch.backends.mkldnn.is_available()),
                                     cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir() / f"batch-invariance-{key}.json"


@functools.cache
def probe(in_features: int, out_features: int, dtype: torch.dtype, device: str, packed: bool, threads: int,
          max_rows: int) -> RowWindow:
    """``measure``, remembered: in this process, and for the CPU in a JSON file beside the
    built kernels (``_probe_cache_path``), so a restarted scheduler does not measure again
    (a bf16 SmolLM2 takes seconds, mostly oneDNN compiling a kernel per row count). Same
    arguments, result and errors as ``measure``."""
    if device != "cpu":
        return measure(in_features, out_features, dtype, device, packed, threads, max_rows)
    path = _probe_cache_path()
    key = f"v{PROBE_VERSION} {in_features}x{out_features} {dtype} packed={packed} threads={threads} rows={max_rows}"
    known = load_json(path)
    if key not in known:
        try:
            window = measure(in_features, out_features, dtype, device, packed, threads, max_rows)
            known[key] = [window.floor, window.cap]
        except NotBatchInvariantError as exc:
            known[key] = str(exc)
        save_json(path, known, "batch-invariance probe")
    if isinstance(known[key], str):
        raise NotBatchInvariantError(known[key])
    return RowWindow(*known[key])


def measure(in_features: int, out_features: int, dtype: torch.dtype, device: str, packed: bool, threads: int,
            max_rows: int) -> RowWindow:
    """The widest window of row counts in which a linear of this shape gives every row the same bits.

    Args:
        in_features, out_features, dtype, device: the weight's shape and placement.
        packed: the weight is oneDNN-packed (``layers.linear.PackedLinear``).
        threads: torch's intra-op thread count (part of the cache key: the split changes with it).
        max_rows: the largest row count a call may need; the caps tried are the powers of two
            from min(``max_rows``, ``MAX_CAP``) down to ``MIN_CAP``. For each, every count a ``RowWindow`` of
            that cap may call with is run on rows 0.. and on rows at another offset, and
            compared with the same rows of one call of ``cap`` rows (and that call with its
            rows reversed, so every row is also computed at another position).

    Returns:
        The window of the largest cap whose agreeing counts reach down to a floor of at most
        ``MAX_PAD_ROWS``; at ``MIN_CAP`` the floor may be the cap itself (every call padded to
        one count).

    Raises:
        NotBatchInvariantError: a row's bits depend on its position in a call.
    """
    gen = torch.Generator(device).manual_seed(0)
    dev = torch.device(device)
    lin = torch.nn.Linear(in_features, out_features, bias=False, device=dev, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_features, in_features, generator=gen, device=dev))
    fn = _call(PackedLinear(lin) if packed else lin)
    cap = max(MIN_CAP, 1 << (min(max_rows, MAX_CAP).bit_length() - 1))
    # Inputs spread over 2^-12..2^12 against unit weights: large partial sums that cancel, so
    # a change of summation order changes the rounded result often (a fifth of the rows of a
    # [576, 1536] bf16 GEMM at one row against many), not once in hundreds as with N(0, 1).
    scale = torch.exp2(torch.randint(-12, 13, (cap, in_features), generator=gen, device=dev).float())
    x = (torch.randn(cap, in_features, generator=gen, device=dev) * scale).to(dtype)
    with torch.inference_mode():
        while True:
            counts = RowWindow(1, cap).counts()  # ascending, up to cap
            ref = fn(x.narrow(0, 0, cap))
            if not torch.equal(fn(x.narrow(0, 0, cap).flip(0)), ref.flip(0)):
                raise NotBatchInvariantError(
                    f"a [{out_features}, {in_features}] {dtype} linear on {device} ({threads} threads) gives a row "
                    f"other bits at another position of a call of {cap} rows: deterministic inference cannot run on "
                    "this GEMM library and CPU")
            floor = 1
            for m in reversed(counts[:-1]):
                shift = (7 * m) % (cap - m + 1)
                if not all(torch.equal(fn(x.narrow(0, j, m)), ref.narrow(0, j, m)) for j in (0, shift)):
                    floor = min(c for c in counts if c > m)
                    break
            if floor <= MAX_PAD_ROWS or cap == MIN_CAP:  # MIN_CAP <= MAX_PAD_ROWS: the last cap always has one
                return RowWindow(floor, cap)
            cap //= 2


def _use_triton(model: torch.nn.Module) -> dict[str, int]:
    """CUDA: every linear and RMSNorm through the fixed-tile Triton kernels (``kernels.triton_batch_invariant``)."""
    from services.scheduler.kernels import triton_batch_invariant as tbi  # triton only where it runs
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


def make_batch_invariant(model: torch.nn.Module, max_rows: int = 1024, kernels: str = "padded",
                         max_floor: int | None = None) -> dict[str, RowWindow]:
    """Make ``model``'s linears batch-invariant, in place; idempotent.

    ``kernels`` "padded" (the CPU's, ``DeviceRuntime.batch_invariant_linears``): every linear
    is wrapped in a ``RowPaddedLinear`` calling it only with the row counts of its measured
    ``RowWindow`` (a wrapped linear is not probed again), and stacked MoE experts
    (``layers.moe.Experts``) get one window for both of their matmuls; every window is
    measured before anything is wrapped. "triton" (CUDA's): every linear and ``RMSNorm``
    runs through the fixed-tile Triton kernels instead (``kernels.triton_batch_invariant``:
    cuBLAS and torch's reductions choose their strategy by shape), with no probe.

    Args:
        max_rows: bounds the probe's largest call (``measure``); the LM head is probed to
            128 rows, as it runs only on the rows that sample (and on a chunk's
            prompt-logprob rows).
        max_floor: refuse (and change nothing) when a window would pad calls of fewer rows
            than this: the default mode's bound on what padding may cost a small batch.

    Returns:
        {module name: window} of the modules wrapped or replaced now (``RowWindow(1, 1)``
        for the Triton ones).

    Raises:
        NotBatchInvariantError: see ``measure``; or a floor above ``max_floor``.
    """
    if kernels == "triton":
        return {name: RowWindow(1, 1) for name in _use_triton(model)}
    threads = torch.get_num_threads()
    linears: list[tuple[str, torch.nn.Module, str, torch.nn.Module, RowWindow]] = []
    experts: list[tuple[str, torch.nn.Module, RowWindow]] = []
    for parent_name, parent in list(model.named_modules()):
        if isinstance(parent, RowPaddedLinear):
            continue
        for name, child in list(parent.named_children()):
            if not isinstance(child, (torch.nn.Linear, PackedLinear)):
                continue
            packed = isinstance(child, PackedLinear)  # oneDNN-packed: bf16 on the CPU
            dtype, device = (torch.bfloat16, "cpu") if packed else (child.weight.dtype, child.weight.device.type)
            rows = min(128, max_rows) if name == "lm_head" else max_rows
            window = probe(child.in_features, child.out_features, dtype, device, packed, threads, rows)
            linears.append((f"{parent_name}.{name}".lstrip("."), parent, name, child, window))
        if callable(getattr(parent, "linear_shapes", None)) and parent.window is None:
            # Stacked MoE experts: one window inside both matmuls' windows (each of its counts
            # is one both verified; see ``RowWindow.counts``).
            packed = parent.packed is not None
            dtype = torch.bfloat16 if packed else parent.gate_up.dtype
            windows = [probe(i, o, dtype, "cpu", packed, threads, max_rows) for i, o in parent.linear_shapes()]
            experts.append((parent_name, parent, RowWindow(max(w.floor for w in windows),
                                                           min(w.cap for w in windows))))
    wrapped = {name: window for name, *_, window in linears} | {name: window for name, _, window in experts}
    if max_floor is not None and wrapped:
        name, window = max(wrapped.items(), key=lambda item: item[1].floor)
        if window.floor > max_floor:
            raise NotBatchInvariantError(
                f"{name} would run every call of fewer than {window.floor} rows padded to {window.floor} rows "
                f"(more than {max_floor}): deterministic inference would cost small batches too much here")
    for _, parent, name, child, window in linears:
        setattr(parent, name, RowPaddedLinear(child, window))
    for _, parent, window in experts:
        parent.window = window
    if wrapped:
        log.info("deterministic inference: %d linears called only at measured row counts (%s)", len(wrapped),
                 ", ".join(sorted({f"floor {w.floor} cap {w.cap}" for w in wrapped.values()})))
    return wrapped
