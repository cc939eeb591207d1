"""``ringserve detokenizer``: serve the Detokenizer gRPC service for one model's vocabulary.

Every Detokenizer RPC needs the ring's internal credential (``ringserve.internal_auth``);
health and reflection stay open."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
from dataclasses import dataclass

from ringserve import grpcutil, tracing
from ringserve.metrics import ServiceMetrics
from ringserve.models.gguf import resolve_model
from ringserve.options.detokenizer import DetokenizerOptions
from ringserve.options.parse import ConfigParser
from ringserve.v1 import detokenizer_pb2, detokenizer_pb2_grpc
from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.metrics import install_detokenizer_metrics
from services.detokenizer.request_trace import RequestTracer
from services.detokenizer.servicer import DetokenizerServicer

log = logging.getLogger("ringserve.detokenizer")


@dataclass(frozen=True, kw_only=True)
class DetokenizerConfig(DetokenizerOptions):
    """Flags of ``ringserve detokenizer``, parsed once (fields: ``DetokenizerOptions``)."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_args(argv: list[str] | None = None) -> DetokenizerConfig:
    """Flags -> DetokenizerConfig (the option table, ``ringserve.options.detokenizer``). A bad
    value exits with status 2 and argparse's message."""
    cli = ConfigParser(DetokenizerConfig, prog="ringserve detokenizer", description=__doc__)
    args, values = cli.parse(argv)
    values["model"] = resolve_model(values["model"])
    return cli.build(args, values)


async def start(config: DetokenizerConfig) -> tuple[grpcutil.ServingServer, DetokenizerServicer]:
    """Load the vocabulary and start the server (and the metrics endpoint, when
    ``config.metrics_port`` is set); health is SERVING when this returns.

    Raises:
        FileNotFoundError: no tokenizer.json under ``config.model``.
        RuntimeError: the address could not be bound.
    """
    manager = DetokenizerManager(config.model, max_decode_states=config.max_decode_states)
    servicer = DetokenizerServicer(manager, instance_id=f"detokenizer@{socket.gethostname()}:{config.port}")
    if tracing.tracer is not None or config.log_requests:
        servicer.requests = RequestTracer(config.log_requests)
    servicer.metrics = ServiceMetrics(config.served_model_name or config.model.resolve().name)
    install_detokenizer_metrics(servicer.metrics, servicer)
    servicer.metrics.serve(config.host, config.metrics_port)
    name = detokenizer_pb2.DESCRIPTOR.services_by_name["Detokenizer"].full_name
    server = await grpcutil.start_server(
        config.address, [(detokenizer_pb2_grpc.add_DetokenizerServicer_to_server, servicer, name)],
        interceptors=config.internal_auth.interceptors(name))
    config.internal_auth.log_state(log, f"the Detokenizer service on port {server.port}")
    log.info("detokenizer on %s:%d (%s path, vocab %d)", config.host, server.port,
             "byte-table" if manager.fast else "offset", manager.vocab_size)
    # Start-up objects (the 262k-entry tables) never need collecting; freezing them keeps
    # GC pauses out of decode steps.
    gc.collect()
    gc.freeze()
    await server.set_serving(True)
    return server, servicer


async def serve(config: DetokenizerConfig) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully: health NOT_SERVING, requests with
    a live decode state get up to ``grace_period_s`` to finish, then the server stops."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server, servicer = await start(config)
    await stop.wait()
    log.info("detokenizer stopping")
    await server.set_serving(False)
    deadline = loop.time() + config.grace_period_s
    while servicer.manager.num_decode_states and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await server.stop(1.0)
    if servicer.metrics is not None:
        servicer.metrics.stop()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = parse_args(argv)
    grpcutil.configure(config.transport)
    tracing.setup("detokenizer", config.tracing)
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
