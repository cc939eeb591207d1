"""The CPU kernels' worker pool (``kernels/cpu/parallel.c``): the same bits as OpenMP regions
for every kernel that runs in parallel, its size follows torch's thread count, and its workers
sleep when no region runs (they spin only a bounded time after each one)."""

from __future__ import annotations

import time

import pytest
import torch

from services.scheduler.kernels import cpu_kernels
from services.scheduler.layers import quant
from services.scheduler.layers.quant import Int8Linear


@pytest.fixture
def pool_and_openmp():
    """Run a callable on the pool and on OpenMP regions; restores the pool after."""
    def both(fn):
        results = []
        for on in (True, False):
            cpu_kernels.set_worker_pool(on)
            results.append(fn())
        return results

    yield both
    cpu_kernels.set_worker_pool(True)


def test_kernels_give_the_same_bits_on_the_pool_as_in_openmp(pool_and_openmp):
    assert torch.get_num_threads() == 2  # tests/scheduler/conftest.py: two threads, so regions run in parallel
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 256, generator=g).bfloat16()  # 40 rows: the row-split kernels run in parallel too
    weight, residual = torch.randn(256, generator=g).bfloat16(), torch.randn(40, 256, generator=g).bfloat16()
    q = torch.randn(40, 6, 64, generator=g).bfloat16()
    kv = torch.randn(300, 2, 64, generator=g).bfloat16()
    idx = torch.randint(0, 300, (40, 50), generator=g)
    lens = torch.randint(1, 51, (40,), generator=g)

    def run():
        res = residual.clone()
        return [cpu_kernels.add_rms_norm(x, weight, 1e-6, res), res, cpu_kernels.silu_and_mul(x),
                cpu_kernels.decode_attention(q, kv, kv, idx, lens, 0.125)]

    pool, omp = pool_and_openmp(run)
    assert all(torch.equal(a, b) for a, b in zip(pool, omp, strict=True))


@pytest.mark.skipif(not quant.cpu_runs_int8(), reason="this CPU has no AVX-512-VNNI: int8 is refused here")
@pytest.mark.parametrize("rows", [1, 40])
def test_int8_linears_give_the_same_bits_on_the_pool_as_in_openmp(pool_and_openmp, rows):
    """Norm in front (40 rows: inside the region, a barrier before the product), every kernel."""
    g = torch.Generator().manual_seed(1)
    linear = Int8Linear(torch.randn(1000, 320, generator=g) * 0.05, None)  # 1000 x 320: above the parallel size
    x = torch.randn(rows, 320, generator=g).bfloat16()
    norm_w, residual = torch.randn(320, generator=g).bfloat16(), torch.randn(rows, 320, generator=g).bfloat16()
    for kernel in (k for k in quant.KERNEL_IDS if linear.can_run(k, torch.bfloat16)):
        def run(kernel=kernel):
            res = residual.clone()
            return linear(x, kernel, norm=(norm_w, 1e-6, res)), res

        (y_pool, r_pool), (y_omp, r_omp) = pool_and_openmp(run)
        assert torch.equal(y_pool, y_omp) and torch.equal(r_pool, r_omp), kernel


def test_the_pool_has_torchs_thread_count_and_sleeps_when_idle():
    cpu_kernels.set_worker_pool(True)
    x = torch.randn(64, 512).bfloat16()
    cpu_kernels.silu_and_mul(x)  # a parallel region: the pool starts its workers
    assert cpu_kernels.pool_threads() == torch.get_num_threads() == 2
    time.sleep(0.05)  # far past the workers' spin (50 us)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    time.sleep(0.2)
    # no thread of this process spins: the CPU time of 0.2 s idle is the interpreter's wake-up only
    assert time.process_time() - cpu0 < 0.02 and time.perf_counter() - wall0 >= 0.2
