"""``ringserve scheduler``: load the model, connect to the detokenizer, serve Scheduler over gRPC.

Health is SERVING once the model is loaded and the detokenizer stream is up. A watchdog
(``--watchdog-timeout``) turns it NOT_SERVING while the engine thread has work pending and
has not finished a step for that long, and back when it moves again. On SIGTERM the
service turns NOT_SERVING, refuses new requests (UNAVAILABLE), lets the ones in flight
finish for up to ``--grace-period`` seconds, aborts what is left and exits 0.

With ``--tp-size N`` this process is rank 0 of N (``engine.tp``): it starts the other ranks,
and when one of them is lost it turns NOT_SERVING, ends every request in flight with
UNAVAILABLE, stops the others and exits 1 (a launcher's ``--restart-on-failure`` then
starts the whole group again).

Every Scheduler RPC needs the ring's internal credential, and the detokenizer stream
presents it (``ringserve.internal_auth``); health and reflection stay open.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import logging
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from ringserve import grpcutil
from ringserve.internal_auth import add_internal_auth_args, internal_auth_from_args
from ringserve.metrics import add_metrics_port_flag
from ringserve.models import resolve_model
from services.scheduler.config import (ATTENTION_BACKENDS, DTYPES, GRAMMAR_BACKENDS, LOAD_FORMATS, SCHEDULE_POLICIES, EngineConfig,
                                      SchedulerConfig)
from services.scheduler.cpus import usable_cpus

log = logging.getLogger("ringserve.scheduler")


def parse_args(argv: list[str] | None) -> SchedulerConfig:
    """Flags -> SchedulerConfig; defaults come from the dataclasses."""
    e, s = EngineConfig(model=Path(".")), SchedulerConfig(engine=EngineConfig(model=Path(".")))
    p = argparse.ArgumentParser(prog="ringserve scheduler", description=__doc__)
    p.add_argument("--model", type=Path, required=True,
                   help="HF model directory (config.json, *.safetensors, tokenizer.json), or a GGUF file: "
                        "converted once into the cache ($RINGSERVE_CACHE_DIR) and reused")
    p.add_argument("--host", default=s.host)
    p.add_argument("--port", type=int, default=s.port, help="gRPC port (0 = any free port)")
    p.add_argument("--detokenizer", default=s.detokenizer, help="detokenizer gRPC address host:port")
    p.add_argument("--instance-id", default=s.instance_id)
    p.add_argument("--device", default=e.device, metavar="{auto,cpu,cuda,cuda:N}",
                   help="where weights, KV cache and sampling live; auto = the first CUDA device torch sees, else cpu")
    p.add_argument("--dtype", choices=DTYPES, default=e.dtype, help="weights and KV cache dtype (attention, softmax and sampling run in fp32); "
                   "auto = on CUDA bfloat16 (compute capability >= 8.0) else float16; on CPU bfloat16 with "
                   "AMX / AVX-512-BF16, else float32; float16 on CUDA only")
    p.add_argument("--max-running-requests", type=int, default=e.max_running_requests, help="req slots")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--max-total-tokens", type=int, default=e.max_total_tokens, help="KV pool size in tokens")
    kv.add_argument("--kv-cache-gib", type=float, default=e.kv_cache_gib, help="KV pool size in GiB")
    p.add_argument("--kv-cache-mem-fraction", type=float, default=e.kv_cache_mem_fraction,
                   help="CPU, without either size: this fraction of the memory available after the weights load")
    p.add_argument("--mem-fraction-static", type=float, default=e.mem_fraction_static,
                   help="CUDA, without either size: weights, KV pool and the activation/CUDA-graph reserve take "
                        "this fraction of the device's memory")
    p.add_argument("--cuda-graph-max-bs", type=int, default=e.cuda_graph_max_bs,
                   help="CUDA: decode batches up to this size replay CUDA graphs captured at start-up")
    p.add_argument("--disable-cuda-graph", action="store_true", help="CUDA: run every decode step eagerly")
    det = p.add_mutually_exclusive_group()
    det.add_argument("--enable-deterministic-inference", dest="deterministic_inference", action="store_const",
                     const=True, default=None,
                     help="a request's tokens and logprobs do not depend on its batch, chunking or prefix-cache hits "
                          "(batch-invariant attention and linears; cpu or triton attention backend). Default: on for "
                          "bf16 on the CPU, off elsewhere")
    det.add_argument("--disable-deterministic-inference", dest="deterministic_inference", action="store_const",
                     const=False, help="turn the default deterministic inference off")
    p.add_argument("--quantization", choices=["int8", "int8wo"], default=None,
                   help="CPU with AVX-512-VNNI: quantize every linear and the LM head to per-channel int8 at load; "
                        "int8 runs W8A8 or weight-only per shape and batch size, whichever measured faster; int8wo "
                        "weight-only (closer to bf16). Default: the checkpoint's weights in --dtype (layers/quant.py)")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="CUDA: plan each step only after the previous one's sampled ids reach the host "
                        "(overlap is off on the CPU, where the forward holds the planning thread)")
    p.add_argument("--max-prefill-tokens", type=int, default=e.max_prefill_tokens, help="token budget of one prefill batch")
    p.add_argument("--context-length", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--seed", type=int, default=None, help="seed for requests that give none")
    p.add_argument("--chunked-prefill-size", type=int, default=e.chunked_prefill_size,
                   help="most prompt tokens prefilled per step, mixed with running decodes (<= 0: no chunking)")
    p.add_argument("--disable-radix-cache", action="store_true", help="run without the prefix (radix) cache")
    p.add_argument("--schedule-policy", choices=SCHEDULE_POLICIES, default=e.schedule_policy,
                   help="admission order: first come first served, or longest cached prefix first")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default=e.load_format,
                   help="dummy = random weights of config.json's shapes (benchmarks)")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=e.attention_backend,
                   help="auto = triton on CUDA devices, cpu (C kernels, built once with cc) on CPU; "
                        "torch = the reference; triton on CPU needs TRITON_INTERPRET=1 (tests)")
    p.add_argument("--grammar-backend", choices=GRAMMAR_BACKENDS, default=e.grammar_backend,
                   help="constrained decoding engine (structured outputs, forced tool calls)")
    p.add_argument("--grammar-compile-timeout", type=float, default=e.grammar_compile_timeout_s,
                   help="seconds a constrained request waits for its grammar to compile, else INVALID_ARGUMENT")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="default: the usable cores (CPU affinity, capped by a cgroup CPU limit)")
    p.add_argument("--max-queued-requests", type=int, default=s.max_queued_requests,
                   help="requests allowed to wait for a request slot; beyond it refuse with RESOURCE_EXHAUSTED")
    p.add_argument("--grace-period", type=float, default=s.grace_period_s,
                   help="seconds in-flight requests get to finish on SIGTERM")
    p.add_argument("--watchdog-timeout", type=float, default=s.watchdog_timeout_s,
                   help="health NOT_SERVING after this many seconds with work pending and no step finished")
    p.add_argument("--max-queued-tokens", type=int, default=s.max_queued_tokens,
                   help="prompt tokens of the requests held (waiting and running) plus the new one's; "
                        "beyond it refuse with RESOURCE_EXHAUSTED (a request is never refused on an idle scheduler)")
    p.add_argument("--tp-size", type=int, default=s.tp_size,
                   help="tensor parallelism: ranks (processes, one device each) this replica is sharded over")
    p.add_argument("--dist-init-addr", default=s.dist_init_addr,
                   help="tensor parallelism: the address rank 0 hosts the group's rendezvous on")
    p.add_argument("--dist-port", type=int, default=s.dist_port,
                   help="tensor parallelism: the rendezvous port (0 = a free port)")
    p.add_argument("--dist-timeout", type=float, default=s.dist_timeout_s,
                   help="tensor parallelism: seconds any collective waits for the other ranks before failing")
    add_metrics_port_flag(p)
    p.add_argument("--served-model-name", default=None,
                   help="model_name label of the metrics (default: the model directory's name)")
    grpcutil.add_transport_args(p)
    add_internal_auth_args(p)
    a = p.parse_args(argv)
    internal_auth = internal_auth_from_args(p, a)
    if a.max_queued_requests is not None and a.max_queued_requests < 0:
        p.error("--max-queued-requests must be >= 0")
    if a.max_queued_tokens is not None and a.max_queued_tokens <= 0:
        p.error("--max-queued-tokens must be > 0")
    if a.max_total_tokens is not None and a.max_total_tokens <= 0:
        p.error("--max-total-tokens must be > 0")
    if a.kv_cache_gib is not None and a.kv_cache_gib <= 0:
        p.error("--kv-cache-gib must be > 0")
    if not 0 < a.kv_cache_mem_fraction < 1:
        p.error("--kv-cache-mem-fraction must be in (0, 1)")
    if not 0 < a.mem_fraction_static < 1:
        p.error("--mem-fraction-static must be in (0, 1)")
    if a.cuda_graph_max_bs < 1:
        p.error("--cuda-graph-max-bs must be >= 1")
    if a.device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", a.device):
        p.error(f"--device {a.device!r}: use auto, cpu, cuda or cuda:N")
    if a.grammar_compile_timeout <= 0:
        p.error("--grammar-compile-timeout must be > 0")
    if a.tp_size < 1:
        p.error("--tp-size must be >= 1")
    if a.dist_timeout <= 0:
        p.error("--dist-timeout must be > 0")
    if a.quantization:  # refused here, before the model loads (torch imported only for it)
        from services.scheduler.engine.device import resolve_device
        from services.scheduler.layers.quant import QuantizationError, check_supported
        try:
            check_supported(a.quantization, resolve_device(a.device))
        except (QuantizationError, ValueError, RuntimeError) as exc:
            p.error(str(exc))
    if importlib.util.find_spec(a.grammar_backend) is None:
        p.error(f"--grammar-backend {a.grammar_backend} needs the {a.grammar_backend} package: "
                f"pip install 'ringserve[{a.grammar_backend}]'")
    engine = EngineConfig(
        model=resolve_model(a.model), dtype=a.dtype, max_running_requests=a.max_running_requests, max_total_tokens=a.max_total_tokens,
        kv_cache_gib=a.kv_cache_gib, kv_cache_mem_fraction=a.kv_cache_mem_fraction,
        max_prefill_tokens=a.max_prefill_tokens, context_length=a.context_length, seed=a.seed,
        chunked_prefill_size=a.chunked_prefill_size, disable_radix_cache=a.disable_radix_cache,
        schedule_policy=a.schedule_policy, load_format=a.load_format, attention_backend=a.attention_backend,
        device=a.device, mem_fraction_static=a.mem_fraction_static, cuda_graph_max_bs=a.cuda_graph_max_bs,
        disable_cuda_graph=a.disable_cuda_graph, overlap_schedule=False if a.disable_overlap_schedule else None,
        grammar_backend=a.grammar_backend, grammar_compile_timeout_s=a.grammar_compile_timeout,
        deterministic_inference=a.deterministic_inference, quantization=a.quantization,
    )
    return SchedulerConfig(engine=engine, host=a.host, port=a.port, detokenizer=a.detokenizer,
                           instance_id=a.instance_id, torch_threads=a.torch_threads,
                           max_queued_requests=a.max_queued_requests, grace_period_s=a.grace_period,
                           watchdog_timeout_s=a.watchdog_timeout, max_queued_tokens=a.max_queued_tokens,
                           transport=grpcutil.transport_from_args(p, a),
                           metrics_port=a.metrics_port, served_model_name=a.served_model_name,
                           tp_size=a.tp_size, dist_init_addr=a.dist_init_addr, dist_port=a.dist_port,
                           dist_timeout_s=a.dist_timeout, internal_auth=internal_auth)


class Watchdog:
    """Health follows the engine thread: NOT_SERVING while it is stalled, SERVING again after.

    Args:
        stalled_s: seconds the engine has had work and not finished a step (``EngineLoop.stalled_s``).
        set_serving: the health setter (``ServingServer.set_serving``).
        timeout_s: stalled this long -> NOT_SERVING.
        ready: whether the service would otherwise be SERVING (the detokenizer stream is up).
    """

    def __init__(self, stalled_s: Callable[[], float], set_serving: Callable[[bool], Awaitable[None]],
                 timeout_s: float, ready: Callable[[], bool]):
        self.stalled_s = stalled_s
        self.set_serving = set_serving
        self.timeout_s = timeout_s
        self.ready = ready
        self.tripped = False

    async def check(self) -> None:
        stalled = self.stalled_s() >= self.timeout_s
        if stalled != self.tripped:
            self.tripped = stalled
            if stalled:
                log.error("watchdog: the engine has had work and made no progress for %.1f s; NOT_SERVING",
                          self.stalled_s())
            else:
                log.warning("watchdog: the engine is making progress again")
            await self.set_serving(self.ready() and not stalled)

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(min(1.0, self.timeout_s / 4))


async def drain(loop, timeout_s: float) -> bool:
    """Refuse new requests and wait up to ``timeout_s`` for the engine to go idle; True if it did."""
    loop.drain()
    deadline = time.monotonic() + timeout_s
    while not loop.idle and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return loop.idle


async def serve(cfg: SchedulerConfig, stop: asyncio.Event | None = None,
                on_serving: Callable[[int], None] | None = None) -> int:
    """Run the scheduler until ``stop`` is set (or SIGTERM/SIGINT when stop is None).

    Health turns SERVING once the model is loaded and the detokenizer stream is up;
    ``on_serving`` then gets the bound port (useful with port 0). Returns the exit status:
    0, or 1 when a tensor-parallel rank was lost.
    """
    import torch

    from ringserve.grpcutil import start_server
    from ringserve.metrics import ServiceMetrics
    from ringserve.v1 import scheduler_pb2, scheduler_pb2_grpc
    from services.scheduler.detok_link import DetokenizerLink
    from services.scheduler.engine.engine import Engine
    from services.scheduler.engine.loop import EngineLoop
    from services.scheduler.engine.tp import TPGroup, rank_threads
    from services.scheduler.layers.parallel import TensorParallel
    from services.scheduler.metrics import SchedulerMetrics
    from services.scheduler.servicer import SchedulerServicer
    from services.scheduler.wire import step_output_to_proto

    # Every multi-threaded torch op runs in the engine thread (EngineLoop sets the count
    # there); this thread loads the model with one. Once a process holds more OpenMP
    # workers than cores, libgomp cuts its workers' spin-wait to ~100 iterations, so a
    # second team started from this thread made every parallel region of a step wake
    # sleeping workers: a batch-64 decode step ran 36 % slower (152 against 112 ms,
    # 2 cores), and in serving 1.3 of the 2 cores stayed busy.
    torch_threads = rank_threads(cfg, usable_cpus())
    torch.set_num_threads(1)
    group = TPGroup.start(cfg) if cfg.tp_size > 1 else None
    engine = Engine.from_config(cfg.engine, group.tp if group else TensorParallel())
    if group is not None:
        group.attach(engine)
    metrics = ServiceMetrics(cfg.model_name)
    SchedulerMetrics(engine, metrics)
    metrics.serve(cfg.host, cfg.metrics_port)
    aio = asyncio.get_running_loop()
    failure: list[str] = []

    def lost_rank(message: str) -> None:  # any thread
        def fail() -> None:
            if not failure:
                log.error("%s: NOT_SERVING, ending every request in flight, exiting", message)
                failure.append(message)
                stop.set()
        aio.call_soon_threadsafe(fail)

    loop = EngineLoop(engine, lambda out: link.send_threadsafe(step_output_to_proto(out)),
                      max_queued_requests=cfg.max_queued_requests, max_queued_tokens=cfg.max_queued_tokens,
                      torch_threads=torch_threads, heartbeat=group.heartbeat if group else None,
                      heartbeat_s=cfg.dist_timeout_s / 4, on_fatal=lost_rank)
    link = DetokenizerLink(
        cfg.detokenizer,
        on_lost=lambda: loop.abort(message="lost the detokenizer stream and its decode state",
                                   status="UNAVAILABLE", resend_init=True),
        metadata=cfg.internal_auth.metadata(),
    )
    servicer = SchedulerServicer(loop, cfg.instance_id, cfg.load_report_interval_s, tp_size=cfg.tp_size)
    name = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
    server = await start_server(cfg.address, [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer, name)],
                                interceptors=cfg.internal_auth.interceptors(name))
    cfg.internal_auth.log_state(log, f"the Scheduler service on port {server.port}")
    link_task = asyncio.create_task(link.run())
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    if group is not None:
        group.watch(lost_rank)
    loop.start()
    log.info("scheduler %s listening on %s:%d, waiting for detokenizer %s", cfg.instance_id, cfg.host, server.port, cfg.detokenizer)
    watchdog_task = None
    try:
        waiter = asyncio.create_task(link.connected.wait())
        await asyncio.wait({waiter, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
        if link.connected.is_set():
            await server.set_serving(True)
            log.info("scheduler SERVING")
            if on_serving is not None:
                on_serving(server.port)
            if cfg.watchdog_timeout_s:
                watchdog = Watchdog(loop.stalled_s, server.set_serving, cfg.watchdog_timeout_s,
                                    link.connected.is_set)
                watchdog_task = asyncio.create_task(watchdog.run())
        await stop.wait()
        if watchdog_task is not None:
            watchdog_task.cancel()
        await server.set_serving(False)
        if failure:
            # The group cannot run a step: end every request now (the engine thread applies
            # it unless a collective holds it; then exiting ends the stream all the same).
            loop.abort(message="a tensor-parallel rank of this replica failed", status="UNAVAILABLE")
            await drain(loop, 0.5)
        elif not await drain(loop, cfg.grace_period_s):
            log.warning("grace period (%.1f s) over; aborting what is still in flight", cfg.grace_period_s)
            loop.abort(message="the scheduler is shutting down", status="UNAVAILABLE")
            await drain(loop, 1.0)
        for _ in range(10 if failure else 20):  # up to 1 s for the last rows to leave on the detokenizer stream
            if link.queue.empty() or not link.connected.is_set():
                break
            await asyncio.sleep(0.05)
    finally:
        if watchdog_task is not None:
            watchdog_task.cancel()
        await server.stop(1.0)
        metrics.stop()
        loop.stop(1.0 if failure else 5.0)
        if group is not None:
            group.stop(graceful=not failure)
        link_task.cancel()
        await asyncio.gather(link_task, return_exceptions=True)
    return 1 if failure else 0


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    grpcutil.configure(cfg.transport)
    # OpenMP's wait policy is left to the environment (libgomp reads it when torch loads).
    # Its default, a spin of a few ms before a worker sleeps, suits cores the scheduler
    # has to itself (a Kubernetes CPU request): on 2 idle cores it gave 361 against 286
    # tok/s at 64 streams and 28.6 against 46.0 ms median ITL at 1 stream, over
    # OMP_WAIT_POLICY=PASSIVE. Where other work shares the cores, spinning workers
    # hold up each other's barriers: with two busy processes beside the ring, PASSIVE
    # gave 159 against 66 tok/s at 16 streams. Set OMP_WAIT_POLICY=PASSIVE there.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Start-up objects (model, torch internals) out of the collector's way once serving:
    # with torch imported, full collections otherwise add ~100 ms pauses to steps.
    sys.exit(asyncio.run(serve(cfg, on_serving=lambda _port: gc.freeze())))


if __name__ == "__main__":
    main()
