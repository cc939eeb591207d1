"""Record Triton launches for a GPU that is not here, compile each one, and read its resource use.

Recording: ``JITFunction.run`` asks the active driver for the device, stream and target, binds
the arguments (argument dtypes, the JIT's divisibility-by-16 and equal-to-1 specializations,
constexprs, launch options) and, before compiling, calls ``knobs.runtime.jit_cache_hook``.
``capturing`` keeps each launch's arguments (a pre-run hook) and makes the launch return
before anything is compiled or launched; ``specialize`` binds them again under a stand-in
driver that answers with a ``GPUTarget``, and keeps the specialization the hook is handed
(Triton's own ``specialization_data`` JSON) once per JIT cache key. What is recorded is what
that GPU's JIT would compile for the same call, because the same code made it.

Compiling: ``JITFunction.preload`` of the recorded JSON runs ``triton.compile`` for the
target, as the JIT would on that GPU (loading the binary is the only step left out).
Registers and spills are what ``ptxas -v`` prints for the cubin (Triton prints its ptxas log
with ``knobs.nvidia.dump_ptxas_log``); shared memory is the kernel's dynamic allocation
(``metadata.shared``) plus any static ``smem`` ptxas reports.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import resource
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context

from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


@dataclass(frozen=True)
class Target:
    """A GPU architecture and its per-block limits.

    From the CUDA C++ Programming Guide, "Compute Capabilities", table "Technical
    Specifications per Compute Capability": maximum shared memory per thread block (with
    the opt-in ``cudaFuncAttributeMaxDynamicSharedMemorySize``, which Triton's launcher
    sets) 163 KB at 8.0 and 227 KB at 9.0; 64 K 32-bit registers per thread block and per
    SM; 255 registers per thread; 1024 threads per block. Registers are allocated per warp
    in units of 256 (8 per thread), as the occupancy calculator counts them.
    """

    name: str
    arch: int
    gpus: str
    shared_per_block: int  # bytes

    @property
    def gpu_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)


REGS_PER_THREAD = 255
REGS_PER_BLOCK = 65536
THREADS_PER_BLOCK = 1024
TARGETS = (Target("sm_80", 80, "A100", 163 * 1024), Target("sm_90", 90, "H100, H200", 227 * 1024))


@dataclass
class Launch:
    """One distinct specialization of one kernel for one target, and the steps that launch it.

    Attributes:
        kernel: the ``@triton.jit`` function.
        specialization: Triton's ``specialization_data`` JSON (what ``JITFunction.preload`` takes).
        sources: "model dtype step" of each recorded launch with this specialization.
    """

    kernel: JITFunction
    specialization: str
    sources: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def constexprs(self) -> dict[str, object]:
        """The named constexprs of the specialization (the JIT's own value-1 specializations of
        integer arguments included), by parameter name."""
        data = json.loads(self.specialization)
        names = self.kernel.arg_names
        pairs = zip(data["constant_keys"], data["constant_vals"], strict=True)
        return {names[k[0]]: v for k, v in pairs if len(k) == 1}

    def dtype(self) -> str:
        """The element type of the kernel's first pointer argument (the model's dtype here)."""
        return next(t[1:] for t in json.loads(self.specialization)["signature"].values() if t.startswith("*"))


class _TargetDriver:
    """What ``JITFunction.run`` asks of Triton's active driver, answered for ``target``: the
    device id is the architecture, so each target gets its own binder (``device_caches``)."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return self.target.arch

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@contextlib.contextmanager
def _driver(target: Target) -> Iterator[None]:
    # driver._active, not driver.active: reading the property would create the default
    # driver, which raises on a machine without a GPU.
    previous = driver._active
    driver.set_active(_TargetDriver(target.gpu_target))
    try:
        yield
    finally:
        driver.set_active(previous)


@dataclass
class Call:
    """One launch as the code made it: the kernel, its arguments and what ran it."""

    kernel: JITFunction
    args: tuple
    kwargs: dict
    source: str


@contextlib.contextmanager
def capturing(kernels: list[JITFunction], source: list[str]) -> Iterator[list[Call]]:
    """Within: every launch of ``kernels`` is kept with its arguments and returns at once
    (nothing is compiled, nothing runs; outputs stay as allocated).

    Args:
        source: a one-item list naming what runs now (e.g. "model dtype step"); the caller
            changes it within, each call is tagged with its current value.

    Yields:
        the calls, in launch order (``specialize`` turns them into a target's launches).
    """
    calls: list[Call] = []
    hooks = []
    for kernel in kernels:
        def hook(*args, _kernel=kernel, **kwargs):
            calls.append(Call(_kernel, args, kwargs, source[0]))
        kernel.pre_run_hooks.append(hook)
        hooks.append((kernel, hook))
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda **_: True  # JITFunction.run returns None: no compile, no launch
    try:
        with _driver(TARGETS[0]):
            yield calls
    finally:
        knobs.runtime.jit_cache_hook = previous
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)


def specialize(calls: list[Call], target: Target) -> list[Launch]:
    """The distinct specializations ``calls`` make on ``target``: each call bound again by its
    kernel's JIT for that target (``JITFunction.run(warmup=True)``), the specialization taken
    from ``jit_cache_hook`` and kept once per JIT cache key."""
    launches: dict[tuple[str, str], Launch] = {}
    current: list[Call] = []

    def hook(*, key, fn, compile, **_) -> bool:
        launch = launches.setdefault((fn.name, str(key)), Launch(fn.jit_function, compile["specialization_data"]))
        if current[0].source not in launch.sources:
            launch.sources.append(current[0].source)
        return True

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        with _driver(target):
            for call in calls:
                current[:] = [call]
                call.kernel.run(*call.args, grid=(1,), warmup=True, **call.kwargs)
    finally:
        knobs.runtime.jit_cache_hook = previous
    return list(launches.values())


@dataclass
class Compiled:
    """A launch compiled for a target: its resources, or the compiler's error.

    Attributes:
        shared: bytes of shared memory per block (dynamic + static).
        registers: 32-bit registers per thread; spill_stores / spill_loads: bytes per
            thread (ptxas); stack: bytes of stack frame per thread (spills and local arrays).
        seconds, cpu_seconds: wall and CPU time of the compile (ptxas included).
    """

    kernel: str
    target: str
    dtype: str
    constexprs: dict[str, object]
    sources: list[str]
    num_warps: int = 0
    num_stages: int = 0
    shared: int = 0
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    error: str | None = None

    def over_limits(self, target: Target) -> list[str]:
        """Each limit of ``target`` this kernel exceeds, said in words (empty: it fits)."""
        if self.error is not None:
            return [f"does not compile: {self.error}"]
        threads = 32 * self.num_warps
        block_regs = -(-self.registers // 8) * 8 * threads
        over = []
        if self.shared > target.shared_per_block:
            over.append(f"shared memory {self.shared} B > {target.shared_per_block} B per block")
        if self.registers > REGS_PER_THREAD:
            over.append(f"{self.registers} registers > {REGS_PER_THREAD} per thread")
        if block_regs > REGS_PER_BLOCK:
            over.append(f"{block_regs} registers per block ({threads} threads) > {REGS_PER_BLOCK}")
        if threads > THREADS_PER_BLOCK:
            over.append(f"{threads} threads > {THREADS_PER_BLOCK} per block")
        return over


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "smem": re.compile(r"(\d+) bytes smem"),
    "spills": re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"),
}


def compile_launch(launch: Launch, target: Target) -> Compiled:
    """Compile ``launch`` for ``target`` -> its resources, or the error the compiler raised (a
    kernel that Triton's cache served, with no ptxas run to read, is reported as an error:
    point ``TRITON_CACHE_DIR`` at an empty directory)."""
    out = Compiled(launch.name, target.name, launch.dtype(), launch.constexprs(), launch.sources)
    log = io.StringIO()
    dump = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    start, cpu = time.perf_counter(), cpu_seconds()
    try:
        with _driver(target), contextlib.redirect_stdout(log):
            kernel = launch.kernel.preload(launch.specialization)
    except Exception as e:  # the compiler's refusal is the finding: report it, compile the rest
        out.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        return out
    finally:
        knobs.nvidia.dump_ptxas_log = dump
        out.seconds, out.cpu_seconds = time.perf_counter() - start, cpu_seconds() - cpu
    text = log.getvalue()
    registers = _PTXAS["registers"].search(text)
    if registers is None:  # ptxas did not run
        out.error = "no ptxas log: the kernel came from Triton's cache (set TRITON_CACHE_DIR to an empty directory)"
        return out
    out.num_warps, out.num_stages = kernel.metadata.num_warps, kernel.metadata.num_stages
    out.registers = int(registers.group(1))
    smem = _PTXAS["smem"].search(text)
    out.shared = kernel.metadata.shared + (int(smem.group(1)) if smem else 0)
    spills = _PTXAS["spills"].search(text)
    if spills:
        out.stack, out.spill_stores, out.spill_loads = map(int, spills.groups())
    return out


def cpu_seconds() -> float:
    """CPU seconds of this process and its waited-for children (ptxas) so far."""
    return sum(sum(resource.getrusage(who)[:2]) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


_PENDING: list[tuple[Launch, Target]] = []


def _compile_pending(i: int) -> Compiled:
    return compile_launch(*_PENDING[i])


def compile_all(work: list[tuple[Launch, Target]], workers: int = 1) -> list[Compiled]:
    """``compile_launch`` over ``work``, in order; ``workers`` > 1 compiles in that many forked
    processes (each compile holds one core: MLIR passes and ptxas)."""
    global _PENDING
    _PENDING = work
    try:
        if workers <= 1:
            return [_compile_pending(i) for i in range(len(work))]
        with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
            return list(pool.map(_compile_pending, range(len(work))))
    finally:
        _PENDING = []
