"""``ringserve scheduler``: load the model, connect to the detokenizer, serve Scheduler over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

from services.scheduler.config import DTYPES, EngineConfig, SchedulerConfig

log = logging.getLogger("ringserve.scheduler")


def parse_args(argv: list[str] | None) -> SchedulerConfig:
    """Flags -> SchedulerConfig; defaults come from the dataclasses."""
    e, s = EngineConfig(model=Path(".")), SchedulerConfig(engine=EngineConfig(model=Path(".")))
    p = argparse.ArgumentParser(prog="ringserve scheduler", description=__doc__)
    p.add_argument("--model", type=Path, required=True, help="HF model directory (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--host", default=s.host)
    p.add_argument("--port", type=int, default=s.port, help="gRPC port (0 = any free port)")
    p.add_argument("--detokenizer", default=s.detokenizer, help="detokenizer gRPC address host:port")
    p.add_argument("--instance-id", default=s.instance_id)
    p.add_argument("--dtype", choices=DTYPES, default=e.dtype, help="weights and KV cache dtype (attention, softmax and sampling run in fp32)")
    p.add_argument("--max-running-requests", type=int, default=e.max_running_requests, help="req slots")
    p.add_argument("--max-total-tokens", type=int, default=e.max_total_tokens, help="KV pool size in tokens")
    p.add_argument("--max-prefill-tokens", type=int, default=e.max_prefill_tokens, help="token budget of one prefill batch")
    p.add_argument("--context-length", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--seed", type=int, default=None, help="seed for requests that give none")
    p.add_argument("--torch-threads", type=int, default=None, help="default: the number of usable cores")
    a = p.parse_args(argv)
    engine = EngineConfig(
        model=a.model, dtype=a.dtype, max_running_requests=a.max_running_requests, max_total_tokens=a.max_total_tokens,
        max_prefill_tokens=a.max_prefill_tokens, context_length=a.context_length, seed=a.seed,
    )
    return SchedulerConfig(engine=engine, host=a.host, port=a.port, detokenizer=a.detokenizer,
                           instance_id=a.instance_id, torch_threads=a.torch_threads)


async def serve(cfg: SchedulerConfig, stop: asyncio.Event | None = None,
                on_serving: Callable[[int], None] | None = None) -> None:
    """Run the scheduler until ``stop`` is set (or SIGTERM/SIGINT when stop is None).

    Health turns SERVING once the model is loaded and the detokenizer stream is up;
    ``on_serving`` then gets the bound port (useful with port 0).
    """
    import torch

    from ringserve.grpcutil import start_server
    from ringserve.v1 import scheduler_pb2, scheduler_pb2_grpc
    from services.scheduler.detok_link import DetokenizerLink
    from services.scheduler.engine.engine import Engine
    from services.scheduler.engine.loop import EngineLoop
    from services.scheduler.servicer import SchedulerServicer
    from services.scheduler.wire import step_output_to_proto

    torch.set_num_threads(cfg.torch_threads or len(os.sched_getaffinity(0)))
    engine = Engine.from_config(cfg.engine)
    loop = EngineLoop(engine, lambda out: link.send_threadsafe(step_output_to_proto(out)))
    link = DetokenizerLink(
        cfg.detokenizer,
        on_reconnect=lambda: loop.abort(message="detokenizer reconnected; its decode state was lost",
                                        status="UNAVAILABLE", resend_init=True),
    )
    servicer = SchedulerServicer(loop, cfg.instance_id, cfg.load_report_interval_s)
    name = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
    server = await start_server(cfg.address, [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer, name)])
    link_task = asyncio.create_task(link.run())
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    loop.start()
    log.info("scheduler %s listening on %s:%d, waiting for detokenizer %s", cfg.instance_id, cfg.host, server.port, cfg.detokenizer)
    try:
        waiter = asyncio.create_task(link.connected.wait())
        await asyncio.wait({waiter, asyncio.create_task(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
        if link.connected.is_set():
            await server.set_serving(True)
            log.info("scheduler SERVING")
            if on_serving is not None:
                on_serving(server.port)
        await stop.wait()
    finally:
        await server.stop(1.0)
        loop.stop()
        link_task.cancel()
        await asyncio.gather(link_task, return_exceptions=True)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    # Before torch loads OpenMP: spinning OpenMP workers on a machine shared with the other
    # services made decode steps 5-10x slower (measured: batch 16, 2 cores, load 5:
    # 306 ms passive against 840-5284 ms spinning).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Start-up objects (model, torch internals) out of the collector's way once serving:
    # with torch imported, full collections otherwise add ~100 ms pauses to steps.
    asyncio.run(serve(cfg, on_serving=lambda _port: gc.freeze()))


if __name__ == "__main__":
    main()
