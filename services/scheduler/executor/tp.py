"""Tensor parallelism's processes: rank 0 (the scheduler) starts ranks 1..N-1 and sends each step to them.

Rank 0 runs the whole scheduler: gRPC, planning, the KV pool's accounting, the prefix cache,
sampling. Ranks > 0 run ``worker_main``: they load their shard, size their KV pool as rank 0
says (``PoolShape``: every rank holds the same rows, each for its own heads) and then run
every step rank 0 broadcasts -- the packed ``StepBatch`` of ``executor.model_runner``, whose
req-to-token writes keep their table equal to rank 0's -- taking part in the forward's
collectives. They hold no request state: their pools' free lists never move.

Messages on the gloo group (``torch.distributed.broadcast_object_list`` from rank 0): a
``StepBatch`` (run it), ``HEARTBEAT`` (rank 0 is idle and alive), a ``lora.registry.LoraOp``
(load or drop a LoRA adapter's shard, between steps) and None (stop). Every
collective has the group's timeout (``--dist-timeout``), so an idle rank 0 sends a heartbeat
more often than that.

Failure: rank 0 owns the other ranks' processes (multiprocessing, forkserver) and watches them;
when one exits, ``on_exit`` runs (the service stops serving and exits 1, so a launcher's
``--restart-on-failure`` starts the whole group again). A rank that loses rank 0 (its
connection closed, a timeout, or the kernel's parent-death signal) exits.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from ringserve.ports import free_port
from services.scheduler.config import SchedulerConfig
from services.scheduler.cpus import usable_cpus
from services.scheduler.executor.build import PoolShape, build_stack, load_engine_model
from services.scheduler.executor.device import create_runtime, rank_device, resolve_device
from services.scheduler.executor.model_runner import ModelRunner, StepBatch
from services.scheduler.executor.prompt_logprobs import LOGITS_SLICE
from services.scheduler.layers.parallel import RankFailure, TensorParallel, init_tensor_parallel
from services.scheduler.lora.registry import LoraOp, open_registry
from services.scheduler.models import check_tensor_parallel

log = logging.getLogger(__name__)

HEARTBEAT = "heartbeat"
_PR_SET_PDEATHSIG = 1


def rank_threads(cfg: SchedulerConfig, usable: int) -> int:
    """torch threads of one rank: ``--torch-threads``, else the usable cores shared out
    evenly over the ranks (at least one each)."""
    return cfg.torch_threads or max(1, usable // cfg.tp_size)


def _broadcast(tp: TensorParallel, obj: object = None) -> Any:
    """Rank 0 sends ``obj``; the others return what it sent. Raises RankFailure."""
    box = [obj]
    try:
        dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    except (RuntimeError, dist.DistError) as exc:
        raise RankFailure(f"tensor-parallel broadcast failed: {exc}") from exc
    return box[0]


class TPGroup:
    """Rank 0's side: the other ranks' processes and the plan broadcast.

    ``start`` spawns ranks 1..N-1 and joins the group; ``attach`` tells them the pools'
    shape and hooks the broadcast into the engine's model runner; ``heartbeat`` keeps idle
    ranks from timing out; ``watch`` reports a rank that exits; ``stop`` ends them.
    """

    def __init__(self, tp: TensorParallel, procs: Sequence[BaseProcess]):
        self.tp = tp
        self.procs = procs
        self._stopping = False

    @classmethod
    def start(cls, cfg: SchedulerConfig) -> TPGroup:
        """Spawn ranks 1..tp_size-1 (each loads its shard), then join the group as rank 0.

        Raises:
            ValueError: the model cannot be sharded over ``cfg.tp_size`` ranks (before any starts).
            RuntimeError: fewer CUDA devices than ranks (before any starts), or the group did not
                form within ``cfg.dist_timeout_s`` (a rank failed to start).
        """
        check_tensor_parallel(cfg.engine.model, cfg.tp_size)
        rank_device(resolve_device(cfg.engine.device), cfg.tp_size - 1)  # raises when a rank has no GPU
        port = cfg.dist_port or free_port()
        cfg = replace(cfg, dist_port=port)
        # A fork server imports torch and the model code once, then forks each rank from
        # that clean, single-threaded process (spawn imports them once per rank; a plain fork
        # would copy this process's gRPC and OpenMP threads' state).
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        procs = [ctx.Process(target=worker_main, args=(rank, cfg), name=f"tp-rank-{rank}", daemon=True)
                 for rank in range(1, cfg.tp_size)]
        for p in procs:
            p.start()
        log.info("tensor parallelism: %d ranks, rendezvous tcp://%s:%d, ranks 1..%d are pids %s",
                 cfg.tp_size, cfg.dist_init_addr, port, cfg.tp_size - 1, [p.pid for p in procs])
        try:
            tp = init_tensor_parallel(0, cfg.tp_size, cfg.dist_init_addr, port,
                                      create_runtime(resolve_device(cfg.engine.device)), cfg.dist_timeout_s)
        except Exception:
            for p in procs:
                p.kill()
            raise
        return cls(tp, procs)

    def attach(self, engine) -> None:
        """Send the engine's pool shape to every rank and broadcast each of its steps from now on."""
        _broadcast(self.tp, PoolShape(engine.max_total_tokens, engine.context_length, engine.cfg.max_running_requests,
                                      engine.deterministic))
        engine.runner.broadcast = self.send
        if engine.lora is not None:  # adapters loaded and dropped at run time, on every rank
            engine.lora.mirror = self.send

    def send(self, batch: StepBatch | LoraOp) -> None:
        """Broadcast one step (called in the engine thread, before rank 0 runs it) or a change of
        the resident LoRA adapters. Raises RankFailure."""
        _broadcast(self.tp, batch)

    def heartbeat(self) -> None:
        """Tell idle ranks that rank 0 is alive (engine thread). Raises RankFailure."""
        _broadcast(self.tp, HEARTBEAT)

    def watch(self, on_exit: Callable[[str], None]) -> None:
        """Call ``on_exit(message)`` from a daemon thread when any other rank's process exits
        (not when ``stop`` ended them)."""

        def run() -> None:
            multiprocessing.connection.wait([p.sentinel for p in self.procs])
            if self._stopping:
                return
            dead = [f"rank {i + 1} (pid {p.pid}, exit code {p.exitcode})" for i, p in enumerate(self.procs)
                    if not p.is_alive()]
            on_exit(f"tensor-parallel {', '.join(dead)} exited")

        threading.Thread(target=run, name="tp-watch", daemon=True).start()

    def stop(self, timeout_s: float = 5.0, graceful: bool = True) -> None:
        """End the other ranks: a stop message when ``graceful`` (after the engine thread has
        stopped: no step may be in flight), then SIGKILL for any still alive after ``timeout_s``."""
        self._stopping = True
        if graceful:
            try:
                _broadcast(self.tp, None)
            except RankFailure as exc:
                log.warning("could not tell the other ranks to stop: %s", exc)
        for p in self.procs:
            p.join(timeout_s if graceful else 0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
        if dist.is_initialized():
            dist.destroy_process_group()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the process that spawned it exits."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def worker_main(rank: int, cfg: SchedulerConfig) -> None:
    """Rank ``rank`` (> 0): join the group, load this rank's shard, build pools of rank 0's
    shape, then run every broadcast step until rank 0 says stop (exit 0) or is lost (exit 1)."""
    _die_with_parent()
    # Rank 0 decides when this rank stops: a Ctrl-C to the process group or a SIGTERM is its to handle.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank-{rank} %(name)s: %(message)s")
    torch.set_num_threads(rank_threads(cfg, usable_cpus()))
    ec = cfg.engine
    device = rank_device(resolve_device(ec.device), rank)
    try:
        tp = init_tensor_parallel(rank, cfg.tp_size, cfg.dist_init_addr, cfg.dist_port, create_runtime(device),
                                  cfg.dist_timeout_s)
        model, runtime = load_engine_model(ec, tp)
        shape: PoolShape = _broadcast(tp)
        stack = build_stack(model, ec, runtime, shape)  # as rank 0's, to rank 0's sizes and decisions
        runner = stack.runner
        open_registry(stack.lora, ec)  # --lora-modules into the slots rank 0 gives them (the same order)
        log.info("rank %d of %d ready: KV pool %d tokens, %d KV heads%s", rank, cfg.tp_size, shape.max_total_tokens,
                 model.kv_shape().num_kv_heads, ", deterministic inference on" if shape.deterministic else "")
        with torch.inference_mode():
            while (batch := _broadcast(tp)) is not None:
                if batch == HEARTBEAT:
                    continue
                if isinstance(batch, LoraOp) and stack.lora is not None:
                    batch.apply(stack.lora, ec.max_lora_rank)
                    continue
                run_step(runner, batch)
    except RankFailure as exc:
        log.error("rank %d lost the group, exiting: %s", rank, exc)
        os._exit(1)
    dist.destroy_process_group()


def run_step(runner: ModelRunner, batch: StepBatch) -> None:
    """A rank > 0's part of one step: the forward, the logits' gather and, when the step
    scores prompt tokens, the same LM-head slices as rank 0's ``score_prompts``."""
    hidden = runner.execute(batch).logprob_hidden
    if hidden is not None:
        n = hidden.shape[0]
        for a in range(0, n, LOGITS_SLICE):
            runner.model.compute_logits(hidden.narrow(0, a, min(LOGITS_SLICE, n - a)))
