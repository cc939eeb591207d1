"""The scheduler's C kernels for CPU (``kernels/cpu/``), built on first use and called through ctypes.

Why: a decode step on CPU is ~30 small ops per layer around four matmuls. At batch 1 their
per-op overhead was ~9 ms of a 32 ms step (one core); at batch 64 the torch decode
attention gathered every request's K/V rows into a copy before two matmuls read it, ~30 %
of the step. These kernels replace them (``cpu/attention.c`` and ``cpu/elementwise.c`` have the
algorithms; ``cpu/int8.c`` holds the int8 linears of ``layers.quant``, ``cpu/decoder.c`` a
step's decoder layers of those linears in one call (``models.layer_stack``), ``cpu/common.h`` what they
share, ``cpu/parallel.c`` their parallel regions):

- ``decode_attention``: reads each request's K/V rows in place in the paged pool.
- ``rotary_store``: rotary on q and k of the fused qkv output, k and v into the pool.
- ``add_rms_norm``: residual add and RMSNorm in one pass.
- ``silu_and_mul``: the MLP's activation.
- ``argmax``: greedy sampling's reduction over the vocabulary (torch's reads ~0.7 G values/s).

Numerics: the element-wise kernels round to bf16 exactly where the torch ops they
replace round (bit-identical, up to the order of RMSNorm's fp32 sum); decode attention
keeps scores, probabilities and the value sum in fp32 and rounds once, at its output
(the torch path rounds scores and probabilities to bf16 between its matmuls).

Build: ``$CC`` (default ``cc``) with ``-O3 -march=native -fopenmp``, the ``.c`` files of
``cpu/`` into one library, once per source (every file of ``cpu/``), compiler and CPU, into
``$RINGSERVE_CACHE_DIR/kernels`` (default ``~/.cache/ringserve/kernels``); about a second.
Threads: every kernel's parallel region runs on the library's persistent worker pool
(``cpu/parallel.c``: N-1 workers started on first use in a process, woken per region, spinning
at most 50 us after it -- not at all while other processes contend for the cores -- and then
sleeping on a futex), with the calling thread's torch thread
count (torch loads ``libgomp.so.1`` first, so the library reads torch's ``set_num_threads``);
``set_worker_pool(False)`` runs them as OpenMP regions instead (the A/B of ``bench/cpu_pool.py``).
ctypes releases the GIL during each call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import os
import subprocess
from pathlib import Path

import torch

SOURCE_DIR = Path(__file__).with_name("cpu")  # the .c files compile into one library; .h files they include
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]


class KernelBuildError(RuntimeError):
    """The C compiler is missing or failed; the message carries its command and output."""


def cache_dir() -> Path:
    """Where built libraries go: ``$RINGSERVE_CACHE_DIR/kernels`` or ``~/.cache/ringserve/kernels``."""
    base = os.environ.get("RINGSERVE_CACHE_DIR") or os.path.expanduser("~/.cache/ringserve")
    return Path(base) / "kernels"


def cpu_flags() -> str:
    """The ``flags`` line of /proc/cpuinfo ("" where there is none): part of every cache key of
    code or measurements that depend on the CPU's instruction sets."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def sources() -> list[Path]:
    """The C sources and headers of ``SOURCE_DIR``, by name: all of them key the library."""
    return sorted(p for p in SOURCE_DIR.iterdir() if p.suffix in (".c", ".h"))


def library_path() -> Path:
    """The built library for this source (every file of ``sources``, names and contents),
    compiler, flags and CPU (``-march=native`` code runs only on CPUs with the builder's
    instruction sets)."""
    try:
        version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelBuildError(f"C compiler {_compiler()!r} not usable ({exc}); install gcc or set CC, "
                               "or run with --attention-backend torch") from exc
    source = "\0".join(f"{p.name}\0{p.read_text()}" for p in sources())
    key = hashlib.sha256("\0".join([source, version, " ".join(CFLAGS), cpu_flags()]).encode())
    return cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile ``cpu/*.c`` into one library unless it is already built; returns its path.

    Raises:
        KernelBuildError: no usable compiler, or compilation failed (compiler output included).
    """
    out = library_path()
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [_compiler(), *CFLAGS, "-o", str(tmp), *(str(p) for p in sources() if p.suffix == ".c"), "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelBuildError(f"building the CPU kernels failed: {' '.join(cmd)}\n{proc.stderr.strip()}")
    os.replace(tmp, out)  # atomic: a concurrent builder's library is the same bytes
    return out


def load_json(path: Path) -> dict:
    """A JSON cache file of measurements beside the kernels ({} when missing or unreadable)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def save_json(path: Path, known: dict, what: str) -> None:
    """Write ``known`` to ``path`` whole and rename it in place (a concurrent scheduler never
    reads half a file); a read-only cache only logs a warning naming ``what``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        logging.getLogger(__name__).warning("%s: cannot keep the result in %s: %s", what, path, exc)


_I64, _F, _I, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded kernel library (built first if needed). Raises KernelBuildError."""
    lib = ctypes.CDLL(str(build()))
    lib.rs_decode_attention.argtypes = [_P, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _F, _I64, _F, _I]
    lib.rs_rotary_store.argtypes = [_P, _I64, _P, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _I]
    lib.rs_add_rms_norm.argtypes = [_P, _P, _P, _P, _I64, _I64, _F, _I]
    lib.rs_silu_and_mul.argtypes = [_P, _P, _I64, _I64, _I]
    lib.rs_argmax.argtypes = [_P, _P, _I64, _I64]
    for fn in (lib.rs_decode_attention, lib.rs_rotary_store, lib.rs_add_rms_norm, lib.rs_silu_and_mul, lib.rs_argmax):
        fn.restype = None
    lib.rs_set_pool.argtypes, lib.rs_set_pool.restype = [_I], _I
    lib.rs_pool_threads.argtypes, lib.rs_pool_threads.restype = [], _I
    return lib


def set_worker_pool(on: bool) -> bool:
    """Run the kernels' parallel regions on the library's worker pool (True, the default) or as
    OpenMP regions (False); returns the previous setting. Results are the same either way
    (each output is computed by one thread in a fixed order); only the speed differs."""
    return bool(library().rs_set_pool(int(on)))


def pool_threads() -> int:
    """Threads of the worker pool in this process (1 until a parallel region has run on it)."""
    return int(library().rs_pool_threads())


def _kind(t: torch.Tensor) -> int:
    """1 for bfloat16, 0 for float32; anything else (or a non-contiguous CPU tensor) raises ValueError."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"CPU kernels take contiguous CPU tensors, got {t.device} contiguous={t.is_contiguous()}")
    if t.dtype == torch.bfloat16:
        return 1
    if t.dtype == torch.float32:
        return 0
    raise ValueError(f"CPU kernels take bfloat16 or float32 tensors, got {t.dtype}")


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, window: int = 0,
                     softcap: float = 0.0, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query per request over its keys, read in place in the paged pool.

    Args:
        q: [B, Hq, D]; k_buf, v_buf: [N, Hkv, D], all one dtype (bf16 or fp32), contiguous.
        kv_indices: int64 [R, L], pool rows of each request's keys in position order
            (entries past a request's length are not read).
        seq_lens: int64 [B], keys of each query (values past L read only L keys; a
            query with none gets zeros).
        scale: softmax scale.
        out: optional [B, Hq, D] destination (may be a row range of a larger tensor).
        window: sliding window in tokens (0: none): only each query's last ``window`` keys
            are read (it sits at position seq_len - 1).
        softcap: attention logit soft-capping ``cap * tanh(s / cap)`` (0: none).
        rows: optional int64 [B], the row of ``kv_indices`` each query reads (default: row
            b, R = B). Several queries of one request -- its extend tokens, each with
            ``seq_lens`` = its position + 1 -- then share the request's row: the
            batch-invariant extend of deterministic inference.

    Returns:
        [B, Hq, D] in q's dtype. Query head h*G+g attends KV head h (G = Hq / Hkv).

    Raises:
        ValueError: a dtype other than bf16/fp32, mixed dtypes, or a non-contiguous tensor.
    """
    b, hq, d = q.shape
    hkv = k_buf.shape[1]
    kind = _kind(q)
    if _kind(k_buf) != kind or _kind(v_buf) != kind:
        raise ValueError(f"q {q.dtype} and the KV pool {k_buf.dtype} must share a dtype")
    if kv_indices.dtype != torch.int64 or seq_lens.dtype != torch.int64 or (
            rows is not None and rows.dtype != torch.int64):
        raise ValueError("kv_indices, seq_lens and rows must be int64")
    kv_indices, seq_lens = kv_indices.contiguous(), seq_lens.contiguous()
    rows = None if rows is None else rows.contiguous()
    if out is None:
        out = torch.empty_like(q)
    library().rs_decode_attention(q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), kv_indices.data_ptr(),
                                  kv_indices.shape[1], None if rows is None else rows.data_ptr(), seq_lens.data_ptr(),
                                  out.data_ptr(), b, hq, hkv, d, scale, window, softcap, kind)
    return out


def rotary_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, loc: torch.Tensor,
                 k_buf: torch.Tensor, v_buf: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Rotate the q and k heads of ``qkv``, write k and v at pool rows ``loc``, return q.

    Args:
        qkv: [T, (Hq + 2 Hkv) * D], the fused projection's output (q heads, k heads, v heads).
        cos, sin: [T, D] (or [T, 1, D]) in qkv's dtype, the rotary tables at each token's position.
        loc: int64 [T], pool rows of the step's tokens.
        k_buf, v_buf: [N, Hkv, D] in qkv's dtype, written in place.
        num_heads: Hq.

    Returns:
        q: [T, Hq, D], rotated.
    """
    t = qkv.shape[0]
    hkv, d = k_buf.shape[1], k_buf.shape[2]
    kind = _kind(qkv)
    for other in (cos, sin, k_buf, v_buf):
        if _kind(other) != kind:
            raise ValueError(f"rotary_store: {other.dtype} beside qkv's {qkv.dtype}")
    q = torch.empty(t, num_heads, d, dtype=qkv.dtype)
    library().rs_rotary_store(qkv.data_ptr(), qkv.shape[1], cos.data_ptr(), sin.data_ptr(), loc.data_ptr(),
                              q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), t, num_heads, hkv, d, kind)
    return q


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` [T, H], or of ``residual + x`` written back into ``residual`` [T, H].

    Returns:
        [T, H] in x's dtype: ``weight * rms_normalized`` as transformers' LlamaRMSNorm
        (normalized in fp32, cast to the dtype, then multiplied by ``weight`` [H]).
    """
    t, h = x.shape
    kind = _kind(x)
    if _kind(weight) != kind or (residual is not None and _kind(residual) != kind):
        raise ValueError("add_rms_norm: x, weight and residual must share a dtype")
    out = torch.empty_like(x)
    library().rs_add_rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                              out.data_ptr(), t, h, eps, kind)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up) -> SiLU(gate) * up [T, I], in gate_up's dtype."""
    t, two_i = gate_up.shape
    kind = _kind(gate_up)
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    library().rs_silu_and_mul(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, kind)
    return out


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D fp32 CPU tensor (the same indices: a NaN counts as the
    largest, of equal values the first), at memory speed: greedy sampling's reduction over the
    vocabulary, 4.4 ms for torch's at 64 rows of 49,152. Anything else goes to torch."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] == 0:
        return x.argmax(dim=-1)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    library().rs_argmax(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
    return out


class CpuOps:
    """``add_rms_norm`` and ``silu_and_mul`` as the object a model's blocks hold
    (``layers.norm.FusedOps``): the cpu attention backend offers it."""

    add_rms_norm = staticmethod(add_rms_norm)
    silu_and_mul = staticmethod(silu_and_mul)
