"""gRPC plumbing shared by every service: server set-up, health, reflection.

Every ringserve service registers the standard gRPC health service
(``grpc.health.v1.Health``) and server reflection next to its own servicers.
Health starts as NOT_SERVING and a service flips itself to SERVING once its
model or tokenizer is loaded and its upstream connections are up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

# Large enough for a BatchTokenIDOutput of a full batch with logprobs.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

CHANNEL_OPTIONS: Sequence[tuple[str, int]] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)

SERVER_OPTIONS: Sequence[tuple[str, int]] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
)


@dataclass
class ServingServer:
    """A started ``grpc.aio`` server plus its health servicer."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]
    port: int

    async def set_serving(self, serving: bool = True) -> None:
        """Set every registered service (and the server as a whole, "") to SERVING or NOT_SERVING."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float | None = 1.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


async def start_server(
    address: str,
    registrations: Sequence[tuple[Callable[[object, grpc.aio.Server], None], object, str]],
) -> ServingServer:
    """Start a ``grpc.aio`` server on ``address`` ("host:port"; port 0 picks a free one).

    Args:
        address: bind address, e.g. "127.0.0.1:30020" or "unix:/tmp/sched.sock".
        registrations: (add_XServicer_to_server, servicer, full service name) triples.

    Returns:
        The started server; health reports NOT_SERVING until ``set_serving()``.

    Raises:
        RuntimeError: the address could not be bound.
    """
    server = grpc.aio.server(options=list(SERVER_OPTIONS))
    names = []
    for add, servicer, name in registrations:
        add(servicer, server)
        names.append(name)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    port = server.add_insecure_port(address)
    if port == 0 and not address.startswith("unix:"):
        raise RuntimeError(f"could not bind gRPC server to {address}")
    await server.start()
    serving = ServingServer(server, health_servicer, tuple(names), port)
    await serving.set_serving(False)
    return serving


def insecure_channel(target: str, extra_options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """An aio channel to another ringserve service, with the shared options (plus ``extra_options``)."""
    return grpc.aio.insecure_channel(target, options=[*CHANNEL_OPTIONS, *extra_options])


async def wait_serving(channel: grpc.aio.Channel, service: str = "", timeout_s: float = 5.0) -> bool:
    """True if the peer's health service reports SERVING for ``service`` within ``timeout_s``."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING
