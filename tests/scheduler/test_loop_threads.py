"""The engine thread runs torch with the scheduler's thread count, the loading thread with its own.

OpenMP keeps the thread count per thread, and a second team of workers (one per thread
that runs parallel torch ops) makes libgomp cut its spin-wait: the scheduler loads the
model with one thread and sets the real count in the engine thread (``EngineLoop``).
"""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import torch

from services.scheduler.engine.loop import EngineLoop


class CountingEngine:
    """One step of work; records torch's thread count and the thread the step ran in."""

    def __init__(self) -> None:
        self.has_work = True
        self.only_compiling = False
        self.grammars = SimpleNamespace(wake=None)  # the loop installs its wake-up callback here
        self.cfg = SimpleNamespace(max_running_requests=1)
        self.seen: list[tuple[int, str]] = []
        self.done = threading.Event()

    def step(self) -> None:
        self.seen.append((torch.get_num_threads(), threading.current_thread().name))
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
