"""``ringserve detokenizer``: serve the Detokenizer gRPC service for one model's vocabulary.

Every Detokenizer RPC needs the ring's internal credential (``ringserve.internal_auth``);
health and reflection stay open."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

from ringserve import grpcutil
from ringserve.internal_auth import InternalAuth, add_internal_auth_args, internal_auth_from_args
from ringserve.metrics import ServiceMetrics, add_metrics_port_flag
from ringserve.models import resolve_model
from ringserve.v1 import detokenizer_pb2, detokenizer_pb2_grpc
from services.detokenizer.manager import DEFAULT_MAX_DECODE_STATES, DetokenizerManager
from services.detokenizer.metrics import install_detokenizer_metrics
from services.detokenizer.servicer import DetokenizerServicer

log = logging.getLogger("ringserve.detokenizer")


@dataclass(frozen=True)
class DetokenizerConfig:
    """Flags of ``ringserve detokenizer``, parsed once."""

    model: Path
    host: str = "127.0.0.1"
    port: int = 30030
    max_decode_states: int = DEFAULT_MAX_DECODE_STATES
    grace_period_s: float = 5.0  # on SIGTERM, how long live decode states may run on
    transport: grpcutil.Transport = grpcutil.Transport()  # message size, TLS
    metrics_port: int | None = None  # Prometheus /metrics on host:port; None = off, 0 = a free port
    served_model_name: str | None = None  # the metrics' model_name label; None = the model directory's name
    internal_auth: InternalAuth = InternalAuth()  # tokens every Detokenizer call needs; empty: none

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def parse_args(argv: list[str] | None = None) -> DetokenizerConfig:
    d = DetokenizerConfig(model=Path("."))
    p = argparse.ArgumentParser(prog="ringserve detokenizer", description=__doc__)
    p.add_argument("--model", type=Path, required=True,
                   help="directory holding tokenizer.json, or a GGUF file (its conversion in the cache, made once)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port")
    p.add_argument("--max-decode-states", type=int, default=d.max_decode_states,
                   help="live per-request decode states kept at most; a request beyond it is aborted")
    p.add_argument("--grace-period", type=float, default=d.grace_period_s,
                   help="seconds in-flight requests get to finish on SIGTERM")
    add_metrics_port_flag(p)
    p.add_argument("--served-model-name", default=None,
                   help="model_name label of the metrics (default: the model directory's name)")
    grpcutil.add_transport_args(p)
    add_internal_auth_args(p)
    a = p.parse_args(argv)
    return DetokenizerConfig(model=resolve_model(a.model), host=a.host, port=a.port, max_decode_states=a.max_decode_states,
                             grace_period_s=a.grace_period, transport=grpcutil.transport_from_args(p, a),
                             metrics_port=a.metrics_port, served_model_name=a.served_model_name,
                             internal_auth=internal_auth_from_args(p, a))


async def start(config: DetokenizerConfig) -> tuple[grpcutil.ServingServer, DetokenizerServicer]:
    """Load the vocabulary and start the server (and the metrics endpoint, when
    ``config.metrics_port`` is set); health is SERVING when this returns.

    Raises:
        FileNotFoundError: no tokenizer.json under ``config.model``.
        RuntimeError: the address could not be bound.
    """
    manager = DetokenizerManager(config.model, max_decode_states=config.max_decode_states)
    servicer = DetokenizerServicer(manager, instance_id=f"detokenizer@{socket.gethostname()}:{config.port}")
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
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
