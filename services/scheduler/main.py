"""``ringserve scheduler``: load the model, connect to the detokenizer, serve Scheduler over gRPC.

Health is SERVING once the model is loaded and the detokenizer stream is up. A watchdog
(``--watchdog-timeout``) turns it NOT_SERVING while the engine thread has work pending and
has not finished a step for that long, and back when it moves again. On SIGTERM the
service turns NOT_SERVING, refuses new requests (UNAVAILABLE), lets the ones in flight
finish for up to ``--grace-period`` seconds, aborts what is left and exits 0.

With ``--tp-size N`` this process is rank 0 of N (``executor.tp``): it starts the other ranks,
and when one of them is lost it turns NOT_SERVING, ends every request in flight with
UNAVAILABLE, stops the others and exits 1 (a launcher's ``--restart-on-failure`` then
starts the whole group again).

Every Scheduler RPC needs the ring's internal credential, and the detokenizer stream
presents it (``ringserve.internal_auth``); health and reflection stay open.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable

from ringserve import grpcutil, tracing
from ringserve.models.gguf import resolve_model
from ringserve.options.parse import ConfigParser
from services.scheduler.config import SchedulerConfig
from services.scheduler.cpus import usable_cpus

log = logging.getLogger("ringserve.scheduler")


def parse_args(argv: list[str] | None) -> SchedulerConfig:
    """Flags -> SchedulerConfig (the option table, ``ringserve.options.scheduler``). A bad value
    exits with status 2 and argparse's message, before the model loads."""
    cli = ConfigParser(SchedulerConfig, prog="ringserve scheduler", description=__doc__)
    args, values = cli.parse(argv)
    method = values["engine.quantization"]
    if method:  # refused here, before the model loads (torch imported only for it)
        from services.scheduler.executor.device import resolve_device
        from services.scheduler.layers.quant import QuantizationError, check_supported
        try:
            check_supported(method, resolve_device(values["engine.device"]))
        except (QuantizationError, ValueError, RuntimeError) as exc:
            cli.error(str(exc))
    backend = values["engine.grammar_backend"]
    if importlib.util.find_spec(backend) is None:
        cli.error(f"--grammar-backend {backend} needs the {backend} package: pip install 'ringserve[{backend}]'")
    values["engine.model"] = resolve_model(values["engine.model"])
    return cli.build(args, values)


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
    from services.scheduler.disagg import service as disagg_service
    from services.scheduler.engine.engine import Engine
    from services.scheduler.engine.loop import EngineLoop
    from services.scheduler.executor.tp import TPGroup, rank_threads
    from services.scheduler.layers.parallel import TensorParallel
    from services.scheduler.metrics import SchedulerMetrics
    from services.scheduler.request_trace import RequestTracer
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
    if tracing.tracer is not None or cfg.log_requests:
        RequestTracer(engine, cfg.log_requests)
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
    servicer = SchedulerServicer(loop, cfg.instance_id, cfg.load_report_interval_s, tp_size=cfg.tp_size,
                                 model_names=frozenset({cfg.model_name, str(cfg.engine.model)}),
                                 disaggregation_mode=cfg.disaggregation_mode)
    name = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
    disagg = disagg_service.serve(cfg, loop, metrics)  # a request's part is per request: every scheduler serves it
    server = await start_server(cfg.address, [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer, name),
                                              disagg.registration],
                                interceptors=cfg.internal_auth.interceptors(name, disagg.registration[2]))
    cfg.internal_auth.log_state(log, f"the Scheduler service on port {server.port}")
    link_task = asyncio.create_task(link.run())
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    if group is not None:
        group.watch(lost_rank)
    loop.start()
    log.info("scheduler %s listening on %s:%d, waiting for detokenizer %s (disaggregation %s, speculative %s)",
             cfg.instance_id, cfg.host, server.port, cfg.detokenizer, cfg.disaggregation_mode,
             cfg.engine.speculative_algorithm)
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
        await disagg.sender.close()
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
    tracing.setup("scheduler", cfg.tracing)
    # Start-up objects (model, torch internals) out of the collector's way once serving:
    # with torch imported, full collections otherwise add ~100 ms pauses to steps.
    sys.exit(asyncio.run(serve(cfg, on_serving=lambda _port: gc.freeze())))


if __name__ == "__main__":
    main()
