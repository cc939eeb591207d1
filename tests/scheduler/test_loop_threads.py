"""The engine thread runs torch with the scheduler's thread count, the loading thread with its own.

OpenMP keeps the thread count per thread, and a second team of workers (one per thread
that runs parallel torch ops) makes libgomp cut its spin-wait: the scheduler loads the
model with one thread and sets the real count in the engine thread (``EngineLoop``), where
a step of few tokens runs on one thread (``executor.step_threads``).
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import torch

from services.scheduler.engine.loop import EngineLoop
from services.scheduler.executor.step_threads import SMALL_STEP_TOKENS, StepThreads


class CountingEngine:
    """One step of work; records torch's thread count and the thread the step ran in, then
    the counts its runner's ``StepThreads`` sets for a small and a large step."""

    def __init__(self) -> None:
        self.has_work = True
        self.only_compiling = False
        self.grammars = SimpleNamespace(wake=None)  # the loop installs its wake-up callback here
        self.cfg = SimpleNamespace(max_running_requests=1)
        self.seen: list[tuple[int, str]] = []
        self.done = threading.Event()
        self.runner = SimpleNamespace(runtime=SimpleNamespace(device=torch.device("cpu")), batch_invariant=False,
                                      model=SimpleNamespace(tp=SimpleNamespace(size=1)), step_threads=None)
        self.per_step: list[int] = []

    def step(self) -> None:
        self.seen.append((torch.get_num_threads(), threading.current_thread().name))
        for tokens in (SMALL_STEP_TOKENS, SMALL_STEP_TOKENS + 1):
            self.runner.step_threads.for_step(tokens)
            self.per_step.append(torch.get_num_threads())
        self.has_work = False
        self.done.set()


def test_engine_thread_sets_its_torch_threads_and_leaves_the_caller_alone():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = CountingEngine()
        loop = EngineLoop(engine, on_output=lambda out: None, torch_threads=2)  # type: ignore[arg-type]
        loop.start()
        try:
            assert engine.done.wait(10)
        finally:
            loop.stop()
        assert engine.seen == [(2, "engine-loop")]
        assert isinstance(engine.runner.step_threads, StepThreads)
        assert engine.per_step == [1, 2]  # a small step on one thread, a larger one on all
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_usable_cpus_caps_the_affinity_by_the_cgroup_quota(tmp_path):
    from services.scheduler.cpus import usable_cpus

    cores = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == cores  # no cpu.max: the affinity
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == cores
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs -> 2 threads
    assert usable_cpus(tmp_path) == min(cores, 2)
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cpus(tmp_path) == 1
