"""A step's thread count (``executor.step_threads``): one thread fewer for a small step, all for
the rest; never where that would give other bits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.scheduler.executor import step_threads
from services.scheduler.executor.step_threads import StepThreads, thread_dependence
from services.scheduler.layers import quant
from services.scheduler.layers.batch_invariant import RowPaddedLinear, RowWindow
from services.scheduler.layers.quant import Int8Linear


class ThreadCountLinear(torch.nn.Linear):
    """A linear whose output moves by one ulp on more than one thread: a GEMM that splits
    a row's sum by thread."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y if torch.get_num_threads() == 1 else torch.nextafter(y, torch.full_like(y, torch.inf))


def test_small_steps_run_on_one_thread_fewer_the_others_on_all():
    before = torch.get_num_threads()
    try:
        threads = StepThreads(2, small_tokens=4)
        assert torch.get_num_threads() == 2
        assert [threads.for_step(n) for n in (1, 4, 5, 64, 3)] == [1, 1, 2, 2, 1]
        assert torch.get_num_threads() == 1
        assert [StepThreads(1, small_tokens=4).for_step(n) for n in (1, 64)] == [1, 1]
        assert [StepThreads(4, small_tokens=4).for_step(n) for n in (1, 64)] == [3, 4]  # a core left over
    finally:
        torch.set_num_threads(before)


def test_a_model_whose_layers_run_in_one_c_call_keeps_every_thread_for_every_step():
    """Its pool's workers stay awake through the step (no Python between its regions)."""
    def runner(cpu_fused: bool) -> SimpleNamespace:
        model = SimpleNamespace(tp=SimpleNamespace(size=1), cpu_fused=cpu_fused)
        return SimpleNamespace(runtime=SimpleNamespace(device=torch.device("cpu")), batch_invariant=False,
                               model=model, step_threads=None)

    before = torch.get_num_threads()
    try:
        one_call, python_loop = runner(True), runner(False)
        assert step_threads.install(one_call, 2) is None and one_call.step_threads is None
        assert torch.get_num_threads() == 2
        assert isinstance(step_threads.install(python_loop, 2), StepThreads)
        assert python_loop.step_threads.for_step(1) == 1
    finally:
        torch.set_num_threads(before)


def test_a_linear_whose_bits_follow_the_thread_count_keeps_every_step_on_all_threads():
    torch.manual_seed(0)
    model = torch.nn.Sequential(RowPaddedLinear(torch.nn.Linear(64, 32, bias=False), RowWindow(2, 32)))
    assert thread_dependence(model, threads=2, small_threads=1) is None  # torch's own GEMM: the same bits
    model.append(RowPaddedLinear(ThreadCountLinear(64, 48, bias=False), RowWindow(2, 32)))
    # the 1-token step's call, padded to the window's floor of 2 rows
    assert thread_dependence(model, threads=2, small_threads=1) == "1 (48x64 torch.float32) at [2] rows"
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(not quant.cpu_runs_int8(), reason="this CPU has no AVX-512-VNNI: int8 is refused here")
def test_int8_linears_give_the_same_bits_on_one_thread_as_on_two():
    """Each output on one thread in a fixed order: the split of the channels does not show."""
    g = torch.Generator().manual_seed(2)
    linear = Int8Linear(torch.randn(1000, 320, generator=g) * 0.05, None)  # above the parallel size
    x = torch.randn(1, 320, generator=g).bfloat16()
    try:
        for kernel in (k for k in quant.KERNEL_IDS if linear.can_run(k, torch.bfloat16)):
            torch.set_num_threads(2)
            two = linear(x, kernel)
            torch.set_num_threads(1)
            assert torch.equal(linear(x, kernel), two), kernel
    finally:
        torch.set_num_threads(2)
