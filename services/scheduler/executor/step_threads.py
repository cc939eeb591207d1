"""How many threads a CPU step runs on: one core fewer for a step of few tokens, all otherwise.

A step of a few tokens is memory-bound: its linears stream the weights once, and one core
more or less changes the bandwidth little. In serving, the ring's other processes (gateway,
tokenizer, detokenizer, and the client) need ~3.6 ms of CPU per token at one stream, on the
same cores: with the engine on every core, each of a step's ~150 parallel regions waits at
its barrier for the worker one of them preempted. A small step on one thread fewer leaves
a core to them (on 2 cores: one thread, no barrier at all); measured in bench/RESULTS.md,
"Threads by a step's size". A larger step is compute-bound and uses every thread.

A model whose decoder layers run as one C call a step (``models.layer_stack``: SmolLM2-like
layers with int8 linears, or bf16 ones on AMX) keeps every thread for every step: with no Python
between its ~150 regions the pool's workers stay awake through the step and leave the core
between steps, and the served int8 median ITL at one stream on 2 cores fell from 12.3-13.2 ms
on one thread to 8.1-8.8 ms on two (bench/RESULTS.md, "One C call a step").

torch's intra-op thread count is the one count that matters: ``torch.set_num_threads`` sets
the calling thread's OpenMP count, which oneDNN's matmuls and the C kernels' worker pool
(``kernels/cpu/parallel.c`` reads ``omp_get_max_threads``) both follow. Setting it costs
~0.15 µs, so it is set per step, and only when it changes.

Results must not depend on it. The C kernels compute each output on one thread in a fixed
order whatever the count (int8 linears, attention, the element-wise kernels). Under
deterministic inference the torch GEMMs of the batch-invariant linears are checked once
(``thread_dependence``): at every padded row count a small step calls them with, one thread
and all threads must give the same bits, or every step keeps all threads.
"""

from __future__ import annotations

import logging

import torch

from services.scheduler.layers.batch_invariant import RowPaddedLinear

log = logging.getLogger(__name__)

# Steps of up to this many tokens (decode rows plus prefill tokens) run on one thread fewer.
# Measured on 2 cores (bench/RESULTS.md, 2026-12-06): at one stream the served median ITL
# fell 1.02-1.05x (bf16) and 1.06-1.25x (int8), the scheduler's CPU per token 8-20 %;
# engine alone one thread stepped as fast as two up to 8 rows there, but only one stream
# was measured served, so larger steps keep every thread.
SMALL_STEP_TOKENS = 1


def small_step_threads(threads: int) -> int:
    """The thread count of a small step on a scheduler of ``threads``: one fewer, at least one."""
    return max(1, threads - 1)


class StepThreads:
    """Sets the engine thread's torch thread count for each step from the step's token count.

    Args:
        threads: the count of every other step (``--torch-threads`` or the usable cores).
        small_tokens: steps of at most this many tokens run on ``small_threads`` (0: never).

    Attributes:
        small_threads: ``threads - 1`` (at least 1): a core left to the ring's other processes.
    """

    def __init__(self, threads: int, small_tokens: int = SMALL_STEP_TOKENS):
        self.threads = threads
        self.small_threads = small_step_threads(threads)
        self.small_tokens = small_tokens
        self._current = threads
        torch.set_num_threads(threads)

    def for_step(self, num_tokens: int) -> int:
        """Set (in the calling thread) and return the thread count of a step of ``num_tokens`` tokens."""
        n = self.small_threads if num_tokens <= self.small_tokens else self.threads
        if n != self._current:
            torch.set_num_threads(n)
            self._current = n
        return n


# What ``thread_dependence`` found per (linear type, shape, dtype, row counts, thread counts):
# a property of the GEMM library and the CPU, so an engine built again checks nothing again.
_AGREES: dict[tuple, bool] = {}


def _same_bits(inner: torch.nn.Module, k: int, m: int, dtype: torch.dtype, threads: int, small_threads: int,
               gen: torch.Generator) -> bool:
    """Whether ``inner`` maps an input of [m, k] to the same bits on both thread counts."""
    scale = torch.exp2(torch.randint(-12, 13, (m, k), generator=gen).float())
    x = (torch.randn(m, k, generator=gen) * scale).to(dtype)
    torch.set_num_threads(threads)
    ref = inner(x)
    torch.set_num_threads(small_threads)
    return torch.equal(inner(x), ref)


def thread_dependence(model: torch.nn.Module, threads: int, small_threads: int,
                      small_tokens: int = SMALL_STEP_TOKENS) -> str | None:
    """Why a small step could give other bits on ``small_threads`` than on ``threads``, or None.

    Runs each distinct shape of ``model``'s batch-invariant torch linears (``RowPaddedLinear``)
    at every row count a step of up to ``small_tokens`` tokens calls it with (after the
    window's padding), on ``small_threads`` and on ``threads``, with inputs spread over 2^-12..2^12
    (a change of summation order then shows, as in ``layers.batch_invariant.measure``).
    Stacked MoE experts with a window are not checked and count as dependent.

    Call it in the thread that runs the steps: OpenMP keeps the count per thread, and a
    second thread's team would cut the first team's spin-wait (``services.scheduler.main``).
    Leaves the calling thread at ``threads``.
    """
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            for name, module in model.named_modules():
                if getattr(module, "window", None) is not None and callable(getattr(module, "linear_shapes", None)):
                    return f"{name}: stacked experts are not checked"
                if not isinstance(module, RowPaddedLinear):
                    continue
                inner = module.inner
                k, n = int(inner.in_features), int(inner.out_features)
                weight = getattr(inner, "weight", None)
                dtype = torch.bfloat16 if weight is None else weight.dtype  # PackedLinear: bf16, no .weight
                rows = sorted({module.window.call_rows(m) for m in range(1, small_tokens + 1)})
                key = (type(inner), k, n, dtype, tuple(rows), threads, small_threads)
                if key not in _AGREES:
                    _AGREES[key] = all(_same_bits(inner, k, m, dtype, threads, small_threads, gen) for m in rows)
                if not _AGREES[key]:
                    return f"{name} ({n}x{k} {dtype}) at {rows} rows"
    finally:
        torch.set_num_threads(threads)
    return None


def install(runner, threads: int) -> StepThreads | None:
    """Set the calling (engine) thread to ``threads`` and, where a small step may run on
    fewer, give ``runner`` (a ``ModelRunner``) the ``StepThreads`` that picks per step.

    Not installed: off the CPU, on one thread, under tensor parallelism (every rank runs its
    own count), for a model that runs its layers in one C call (``cpu_fused``: see the module
    docstring) and where ``thread_dependence`` finds a linear whose bits would change.
    Returns what was installed, or None.
    """
    torch.set_num_threads(threads)
    if runner.runtime.device.type != "cpu" or threads <= 1 or SMALL_STEP_TOKENS < 1 or runner.model.tp.size > 1:
        return None
    if getattr(runner.model, "cpu_fused", False):
        log.info("every step runs on %d threads: the decoder layers run in one C call", threads)
        return None
    small = small_step_threads(threads)
    why = thread_dependence(runner.model, threads, small) if runner.batch_invariant else None
    if why is not None:
        log.info("every step runs on %d threads: %d would give other bits (%s)", threads, small, why)
        return None
    runner.step_threads = StepThreads(threads)
    log.info("steps of up to %d tokens run on %d threads, the others on %d", SMALL_STEP_TOKENS, small, threads)
    return runner.step_threads
