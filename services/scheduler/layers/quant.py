"""int8 weights for the CPU: ``--quantization int8`` and ``--quantization int8wo``.

Every linear of the decoder and the LM head is quantized at load, from the checkpoint's
bf16/fp32 weights, to symmetric int8 with one fp32 scale per output channel
(``scale[n] = max_k |w[n, k]| / 127``). Three C kernels (``kernels/cpu/int8.c``) run them from one
packed layout (VNNI's 16 output channels x 4 input channels per 64-byte block, four blocks
interleaved so that a thread reads its weights as one sequential stream):

- ``w8a8``: activations quantized per token on the fly (symmetric, ``amax / 127``), u8 x s8
  dot products summed exactly in int32 (AVX-512-VNNI ``vpdpbusd``), dequantized in fp32
  (the dynamic per-token scheme of LLM.int8()'s vector-wise quantization, Dettmers et al.
  2022, without its outlier split; SmoothQuant's W8A8 GEMM, Xiao et al. 2023). From 8 rows,
  where the CPU has AMX-INT8 and K is a multiple of 64, on the tiles (``TDPBUSD``,
  ``kernels/cpu/amx.c``, reading the same packed blocks): the same exact int32 sums, so the
  same bits, at 2x the AVX-512 tiles' speed from 16 rows.
- ``w8``: weight-only; the int8 weights widened to fp32 and FMA'd against the activations
  as they are (more exact; for a few rows, where a step reads weights and computes little).
- ``w8bf16``: weight-only for bf16 activations and many rows: each 16-channel block widened
  once per call to bf16 (exact) and run with AVX-512-BF16 ``vdpbf16ps`` on every row. ``w8``
  sums in ``vdpbf16ps``'s order, one FMA chain per output, so the two give the same bits.
- ``w8amx``: weight-only for bf16 activations on AMX-BF16 tiles (``kernels/cpu/amx.c``): on
  CPUs with AMX, oneDNN's bf16 GEMM runs on the tiles and the AVX-512 weight-only kernels
  were 2.6x slower than bf16 at 64 rows. Batch-invariant too, but its sums are not
  ``w8``'s bits (the tiles' internal order), so deterministic inference pins a linear that
  mixes them (``fix_kernels``).

``int8`` runs, per weight shape and per row-count bucket (``ROW_BUCKETS``), whichever kernel
measured faster, once per CPU, thread count and kernel build, kept in the kernel cache
(``choose_kernels``); ``int8wo`` (torchao's name for it) the faster weight-only one. Quality on
20,000 tokens of Python's documentation (``tests/scheduler/test_quantization.py``,
``bench/int8_quality.py``) against bf16, SmolLM2-135M: ``int8wo`` perplexity +0.3 %, greedy
agreement 95 %; ``int8`` (W8A8 on this CPU) +4.5 %, 88 %. fp32 itself agrees with bf16 on
97.5 % of the tokens: the near-ties of bf16 logits flip under any other rounding.

On the EPYC (AVX-512-VNNI, no AMX) the kernels were measured against oneDNN through torch
(``torch._int_mm`` for W8A8, ``torch.ops.aten._weight_int8pack_mm`` for weight-only) and
bf16 oneDNN; W8A8 in C won every SmolLM2 shape at 1 and 64 rows (``bench/int8_kernels.py``,
``bench/RESULTS.md``), so the runtime chooses between the C kernels only.

Deterministic inference: ``w8a8`` is batch-invariant by construction (an exact int32 sum,
per-row scales), and so are ``w8``/``w8bf16`` (one order whatever the tile, the same bits as
each other); switching between W8A8 and weight-only with the row count is not, so
``fix_kernels`` pins one of the two per shape (and ``int8wo``'s ``w8amx``, whose bits
differ from ``w8``'s, against the other two).

Needs AVX-512-VNNI (AMX-INT8 CPUs have it too): elsewhere ``check_supported`` raises.
"""

from __future__ import annotations

import hashlib
import logging
import time

import torch

from ringserve.options import names
from services.scheduler.kernels.cpu_kernels import cache_dir, cpu_flags, library_path, load_json, save_json
from services.scheduler.layers.cpu_linear import AmxBf16Linear, CpuLinear, lib
from services.scheduler.layers.linear import PackedLinear

log = logging.getLogger(__name__)

QUANTIZATION_METHODS = names.QUANTIZATION_METHODS  # the flag's choices; check_supported refuses others
KERNEL_IDS = ("w8a8", "w8", "w8bf16", "w8amx")  # rs_int8_linear's kernel ids, in order
KERNELS = KERNEL_IDS[:3]  # what ``int8`` chooses from (fix_kernels knows their bits)
WEIGHT_ONLY = ("w8", "w8bf16", "w8amx")  # what ``int8wo`` chooses from
ROW_BUCKETS = (1, 4, 16, 64)  # a call of M rows runs the kernel measured for the largest bucket <= M


class QuantizationError(ValueError):
    """``--quantization`` cannot run here (method, device or CPU named in the message)."""


def check_supported(method: str, device: torch.device) -> None:
    """Refuse a quantization this build cannot run.

    Raises:
        QuantizationError: an unknown method, a device other than the CPU, or a CPU
            without AVX-512-VNNI (its /proc/cpuinfo flags named).
    """
    if method not in QUANTIZATION_METHODS:
        raise QuantizationError(f"unknown --quantization {method!r}; supported: {', '.join(QUANTIZATION_METHODS)}")
    from services.scheduler.executor.device import create_runtime  # the device's runtime says what runs there

    if not create_runtime(device).int8_linears:
        raise QuantizationError(f"--quantization {method} runs on the CPU only (its kernels are AVX-512-VNNI C), "
                                f"not on {device}; serve the bf16 weights there")
    if not cpu_runs_int8():
        raise QuantizationError(f"--quantization {method} needs a CPU with AVX-512-VNNI (or AMX-INT8, which has it); "
                                "this CPU's flags have neither avx512_vnni nor amx_int8")


def cpu_runs_int8() -> bool:
    """Whether this CPU (its /proc/cpuinfo flags) and the built C library run the int8 kernels."""
    return "avx512_vnni" in cpu_flags().split() and bool(lib().rs_int8_available())


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of ``weight`` [N, K] (any float dtype, CPU).

    Returns:
        packed: int8 [Np / 64, Kp / 4, 4, 16, 4] (Np, Kp: N and K rounded up to 64 and 4,
            zero-padded), the kernels' layout (``unpack`` inverts it);
        scale: fp32 [Np], ``max_k |w[n, k]| / 127`` (0 for padding and all-zero rows);
        comp: int32 [Np], ``128 * sum_k q[n, k]``, what the u8 activation offset adds.
    """
    n, k = weight.shape
    np_, kp = -(-n // 64) * 64, -(-k // 4) * 4
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    q = torch.zeros(np_, kp, dtype=torch.int8)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q[:n, :k] = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    scale_p = torch.zeros(np_, dtype=torch.float32)
    scale_p[:n] = scale
    comp = (q.to(torch.int32).sum(dim=1) * 128).to(torch.int32)
    packed = q.view(np_ // 64, 4, 16, kp // 4, 4).permute(0, 3, 1, 2, 4).contiguous()
    return packed, scale_p, comp


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """``quantize_weight``'s packed int8 -> the padded [Np, Kp] int8 matrix."""
    groups, k4 = packed.shape[:2]
    return packed.permute(0, 2, 3, 1, 4).reshape(groups * 64, k4 * 4)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The fp32 [n, k] weight ``quantize_weight``'s outputs stand for (tests, quality checks)."""
    return (unpack(packed).float() * scale[:, None])[:n, :k]


class Int8Linear(CpuLinear):
    """``y = x @ W^T + b`` with W in int8 (``quantize_weight``), on the CPU.

    Args:
        weight: [out_features, in_features], float; quantized here (the caller drops it).
        bias: [out_features] or None; kept in fp32.

    Raises:
        QuantizationError: the CPU cannot run the kernels (``cpu_runs_int8``).

    Attributes:
        kernels: ((min_rows, kernel), ...) ascending; a call of T rows runs the kernel of
            the largest min_rows <= T (``choose_kernels`` fills it; default ``w8a8`` for all).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if not cpu_runs_int8():  # the library's kernels would abort the process on this CPU
            raise QuantizationError("Int8Linear needs a CPU with AVX-512-VNNI; this CPU's flags have no avx512_vnni")
        self.out_features, self.in_features = weight.shape
        packed, scale, comp = quantize_weight(weight)
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("comp", comp)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self.k_padded = packed.shape[1] * 4
        self.kernels: tuple[tuple[int, str], ...] = ((1, "w8a8"),)
        self.timings: dict[int, dict[str, float]] = {}  # choose_kernels': {rows: {allowed kernel: ms}}
        self.out_dtype: torch.dtype | None = None  # None: x's; float32 for the LM head (see quantize_model)

    @property
    def shape_key(self) -> str:
        return f"{self.out_features}x{self.in_features}"

    def can_run(self, kernel: str, dtype: torch.dtype) -> bool:
        """Whether ``kernel`` runs this linear on ``dtype`` activations here (``w8bf16``: bf16
        activations, in_features a multiple of 4, a CPU with AVX-512-BF16; ``w8amx``: bf16
        activations, in_features a multiple of 32, a CPU and kernel with AMX-BF16)."""
        if kernel == "w8amx":
            return dtype == torch.bfloat16 and self.in_features % 32 == 0 and bool(lib().rs_w8_amx_available())
        if kernel != "w8bf16":
            return kernel in KERNEL_IDS
        return dtype == torch.bfloat16 and self.in_features == self.k_padded and bool(lib().rs_w8_bf16_available())

    def kernel_id(self, kernel: str, dtype: torch.dtype) -> int:
        """``rs_int8_linear``'s id of ``kernel`` on ``dtype`` activations: ``w8`` for a bf16-only
        kernel on fp32 ones (the kernels were chosen for the model's bf16)."""
        if kernel in ("w8bf16", "w8amx") and not self.can_run(kernel, dtype):
            kernel = "w8"
        return KERNEL_IDS.index(kernel)


def quantize_model(model: torch.nn.Module, method: str) -> int:
    """Replace every ``nn.Linear`` / ``PackedLinear`` of ``model`` (decoder and LM head) by an
    ``Int8Linear``, in place; the embedding (one row read per token) and the norms stay in
    the model dtype, and so do stacked MoE experts (``layers.moe``, logged). ``int8wo``
    runs only the weight-only kernels, ``int8`` any (``choose_kernels`` picks per batch size).

    Returns:
        How many linears were quantized.

    Raises:
        QuantizationError: see ``check_supported`` (the model's device).
    """
    device = next(model.parameters()).device
    check_supported(method, device)
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear):
                weight, bias = child.weight, child.bias
            elif isinstance(child, (PackedLinear, AmxBf16Linear)):
                raise QuantizationError("quantize the model before packing its bf16 linears")
            else:
                continue
            linear = Int8Linear(weight, bias)
            if method == "int8wo":
                linear.kernels = ((1, "w8"),)  # until choose_kernels picks among the weight-only ones
            setattr(module, name, linear)
            count += 1
    left = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    if left:
        log.warning("--quantization %s: %d expert weights stay %s (stacked MoE experts are not quantized)",
                    method, left, next(model.parameters()).dtype)
    return count


def int8_linears(model: torch.nn.Module) -> list[Int8Linear]:
    """Every ``Int8Linear`` of ``model``."""
    return [m for m in model.modules() if isinstance(m, Int8Linear)]


def _plan_cache_path():
    """Where kernel timings persist: one JSON per kernel build (source, compiler, CPU) and torch."""
    key = hashlib.sha256("\0".join([library_path().name, torch.__version__, cpu_flags()]).encode()).hexdigest()[:16]
    return cache_dir() / f"int8-kernels-{key}.json"


def measure_kernels(linear: Int8Linear, dtype: torch.dtype, repeats: int = 20) -> dict[int, dict[str, float]]:
    """Median milliseconds of each kernel of ``KERNEL_IDS`` that can run (``Int8Linear.can_run``) on
    ``linear`` at each of ``ROW_BUCKETS`` rows (random ``dtype`` activations, this thread's torch
    thread count)."""
    times: dict[int, dict[str, float]] = {}
    for rows in ROW_BUCKETS:
        x = torch.randn(rows, linear.in_features).to(dtype)
        times[rows] = {}
        for kernel in (k for k in KERNEL_IDS if linear.can_run(k, dtype)):
            linear(x, kernel)  # warm: first touch of the weights
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                linear(x, kernel)
                samples.append((time.perf_counter() - t0) * 1e3)
            times[rows][kernel] = sorted(samples)[len(samples) // 2]
    return times


def choose_kernels(model: torch.nn.Module, dtype: torch.dtype,
                   allowed: tuple[str, ...] = KERNELS) -> dict[str, dict[int, dict[str, float]]]:
    """Set each ``Int8Linear``'s ``kernels`` to the fastest of ``allowed`` per row bucket, from
    timings of every kernel measured once per shape, dtype and thread count and kept in the
    kernel cache (a few seconds for SmolLM2's five shapes).

    Returns:
        The timings used: {shape: {rows: {kernel: ms}}}.
    """
    threads = torch.get_num_threads()
    path = _plan_cache_path()
    known = load_json(path)
    used: dict[str, dict[int, dict[str, float]]] = {}
    changed = False
    for linear in int8_linears(model):
        key = f"{linear.shape_key} {dtype} threads={threads}"
        if key not in known:
            known[key] = {str(r): t for r, t in measure_kernels(linear, dtype).items()}
            changed = True
        timings = {int(r): t for r, t in known[key].items()}
        used[linear.shape_key] = timings
        linear.kernels = tuple((r, min((k for k in t if k in allowed), key=t.get)) for r, t in sorted(timings.items()))
        linear.timings = {r: {k: ms for k, ms in t.items() if k in allowed} for r, t in timings.items()}
    if changed:
        save_json(path, known, "int8 kernel timings")
    return used


# Kernels that give each other's bits: a linear may switch within a family with the row count.
FAMILY = {"w8a8": 0, "w8": 1, "w8bf16": 1, "w8amx": 2}


def _regret(timings: dict[int, dict[str, float]], family: tuple[str, ...]) -> float:
    """How many times slower than each bucket's fastest kernel ``family``'s best is, at its worst bucket."""
    return max(min(ms for k, ms in b.items() if k in family) / min(b.values()) for b in timings.values())


def fix_kernels(model: torch.nn.Module) -> int:
    """Deterministic inference: pin each ``Int8Linear`` whose kernels mix families (``FAMILY``:
    W8A8 and weight-only in ``int8``; ``w8amx`` and the AVX-512 weight-only ones in ``int8wo``)
    to one kernel for every row count, so a row's bits do not depend on its batch; ``w8`` and
    ``w8bf16`` give each other's bits and stay as chosen. The kernel: with ``w8amx`` in the mix
    and ``choose_kernels``' timings, the family whose slowest bucket is least slower than that
    bucket's fastest kernel (``w8amx`` loses ~2x at one row and wins ~6x at 64 on SmolLM2's
    shapes: counting buckets would pin the 6x loss); otherwise the one chosen for the most
    row buckets (on a tie the one of the fewest rows). Returns how many were pinned."""
    pinned = 0
    for linear in int8_linears(model):
        chosen = [k for _, k in linear.kernels]
        if "w8amx" in chosen and len(set(chosen)) > 1 and "w8a8" not in chosen and linear.timings:
            t = linear.timings
            if _regret(t, ("w8amx",)) <= _regret(t, ("w8", "w8bf16")):
                linear.kernels = ((1, "w8amx"),)
            else:
                linear.kernels = tuple((r, min((k for k in t[r] if k != "w8amx"), key=t[r].get))
                                       for r, _ in linear.kernels)
            pinned += 1
            continue
        if len({FAMILY[k] for k in chosen}) > 1:
            linear.kernels = ((1, max(chosen, key=chosen.count)),)  # max keeps the first of equal counts
            pinned += 1
    return pinned


def describe(model: torch.nn.Module) -> str:
    """One line for the log: how many int8 linears run which kernel at 1 and 64 rows."""
    linears = int8_linears(model)
    parts = []
    for rows in (1, 64):
        kinds = [m.kernel_for(rows) for m in linears]
        parts.append(f"at {rows} rows " + ", ".join(f"{kinds.count(k)} {k}" for k in KERNEL_IDS if k in kinds))
    return f"{len(linears)} int8 linears ({'; '.join(parts)})"
