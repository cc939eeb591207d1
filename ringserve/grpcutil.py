"""gRPC plumbing shared by every service: server set-up, health, reflection, transport.

Every ringserve service registers the standard gRPC health service
(``grpc.health.v1.Health``) and server reflection next to its own servicers.
Health starts as NOT_SERVING and a service flips itself to SERVING once its
model or tokenizer is loaded and its upstream connections are up. The service name
``liveness`` is SERVING from start to shutdown, for liveness probes.

Transport (``Transport``, one per process, set by each service's ``main`` through
``configure``): the largest message sent or received (a bigger one ends the call with
RESOURCE_EXHAUSTED, "Received message larger than max"), and optional TLS. With a
certificate and key a server speaks TLS; adding a CA makes it mutual: servers require
and verify a client certificate signed by that CA, and channels present the same
certificate and key. Channels verify the server against the CA (the system roots when
none is given). Every server and channel in the ring takes these settings, so one set
of flags (``add_transport_args``) configures a service both ways.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .grpc_decode import DecodeErrorInterceptor

# Large enough for a BatchTokenIDOutput of a full batch with logprobs.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# The health service name that is SERVING from start to shutdown whatever the peers do:
# liveness probes ask for it, so a stalled peer turns a service unready without restarting it.
LIVENESS = "liveness"


@dataclass(frozen=True)
class Transport:
    """How one process's gRPC servers and channels talk.

    Attributes:
        max_message_bytes: largest message a server or channel sends or receives, in bytes.
        tls_cert_file: PEM certificate chain this process presents (server, and client
            under mutual TLS); None = plaintext.
        tls_key_file: PEM private key of ``tls_cert_file``.
        tls_ca_file: PEM CA bundle. Servers then require client certificates signed by it
            (mutual TLS); channels verify servers against it.
    """

    max_message_bytes: int = MAX_MESSAGE_BYTES
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_ca_file: Path | None = None

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    @property
    def mutual(self) -> bool:
        return self.tls and self.tls_ca_file is not None

    def args(self) -> list[str]:
        """The flags (``add_transport_args``) that give another process this transport."""
        out = ["--grpc-max-message-bytes", str(self.max_message_bytes)]
        for flag, path in (("--tls-cert-file", self.tls_cert_file), ("--tls-key-file", self.tls_key_file),
                           ("--tls-ca-file", self.tls_ca_file)):
            if path is not None:
                out += [flag, str(path)]
        return out

    def server_credentials(self) -> grpc.ServerCredentials:
        assert self.tls_cert_file is not None and self.tls_key_file is not None
        pair = (self.tls_key_file.read_bytes(), self.tls_cert_file.read_bytes())
        ca = self.tls_ca_file.read_bytes() if self.tls_ca_file is not None else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca = self.tls_ca_file.read_bytes() if self.tls_ca_file is not None else None
        if self.mutual:
            assert self.tls_cert_file is not None and self.tls_key_file is not None
            return grpc.ssl_channel_credentials(ca, self.tls_key_file.read_bytes(), self.tls_cert_file.read_bytes())
        return grpc.ssl_channel_credentials(ca)

    def _size_options(self) -> list[tuple[str, int]]:
        return [("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.max_receive_message_length", self.max_message_bytes)]

    def channel_options(self) -> list[tuple[str, int]]:
        return self._size_options() + [
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]

    def server_options(self) -> list[tuple[str, int]]:
        return self._size_options() + [
            # gRPC sets SO_REUSEPORT by default, so a second server on a taken port would
            # share it silently (and take half the connections): fail to bind instead.
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            # Pings from the server too: a peer gone without a FIN (a network blip) ends its
            # streams within ~15 s, so its Connect/Subscribe registration does not outlive it
            # and block the same peer's reconnect (one id, one stream).
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.http2.max_pings_without_data", 0),
        ]


_transport = Transport()

CHANNEL_OPTIONS: Sequence[tuple[str, int]] = tuple(Transport().channel_options())
SERVER_OPTIONS: Sequence[tuple[str, int]] = tuple(Transport().server_options())


def configure(transport: Transport) -> None:
    """Set this process's transport; each service's ``main`` calls it once, before serving."""
    global _transport
    _transport = transport


def add_transport_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--grpc-max-message-bytes`` and the ``--tls-*`` flags to a service's parser."""
    d = Transport()
    parser.add_argument("--grpc-max-message-bytes", type=int, default=d.max_message_bytes,
                        help="largest gRPC message sent or received (bytes); bigger: RESOURCE_EXHAUSTED")
    parser.add_argument("--tls-cert-file", type=Path, default=None,
                        help="PEM certificate: gRPC servers speak TLS (and channels present it under mutual TLS)")
    parser.add_argument("--tls-key-file", type=Path, default=None, help="PEM private key of --tls-cert-file")
    parser.add_argument("--tls-ca-file", type=Path, default=None,
                        help="PEM CA: channels verify servers with it; with --tls-cert-file, mutual TLS "
                             "(servers require client certificates signed by it)")


def transport_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Transport:
    """The ``Transport`` of parsed ``add_transport_args`` flags; a bad combination is a parser error."""
    if (args.tls_cert_file is None) != (args.tls_key_file is None):
        parser.error("--tls-cert-file and --tls-key-file go together")
    if args.grpc_max_message_bytes <= 0:
        parser.error("--grpc-max-message-bytes must be > 0")
    for path in (args.tls_cert_file, args.tls_key_file, args.tls_ca_file):
        if path is not None and not path.is_file():
            parser.error(f"{path}: no such file")
    return Transport(args.grpc_max_message_bytes, args.tls_cert_file, args.tls_key_file, args.tls_ca_file)


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
    registrations: Sequence[tuple[Callable[[Any, grpc.aio.Server], None], object, str]],
    transport: Transport | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> ServingServer:
    """Start a ``grpc.aio`` server on ``address`` ("host:port"; port 0 picks a free one).

    Args:
        address: bind address, e.g. "127.0.0.1:30020" or "unix:/tmp/sched.sock".
        registrations: (add_XServicer_to_server, servicer, full service name) triples.
        transport: message size and TLS; default: the process's (``configure``).
        interceptors: run on every call, in order, before the servicer (the credential checks:
            ``ringserve.grpc_auth``).

    Returns:
        The started server; health reports NOT_SERVING until ``set_serving()``, and
        SERVING for ``LIVENESS`` until it stops.

    Raises:
        RuntimeError: the address could not be bound.
    """
    transport = transport or _transport
    # Credential checks come first: a refused call does no work, not even parsing.
    chain = [*interceptors, DecodeErrorInterceptor()]
    server = grpc.aio.server(options=transport.server_options(), interceptors=chain)
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
    if transport.tls:
        port = server.add_secure_port(address, transport.server_credentials())
    else:
        port = server.add_insecure_port(address)
    if port == 0 and not address.startswith("unix:"):
        raise RuntimeError(f"could not bind gRPC server to {address}")
    await server.start()
    serving = ServingServer(server, health_servicer, tuple(names), port)
    await serving.set_serving(False)
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    return serving


def insecure_channel(target: str, extra_options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """A plaintext aio channel with the default options (plus ``extra_options``): tests and
    tools; the services use ``channel``, which follows the process's transport."""
    return grpc.aio.insecure_channel(target, options=[*CHANNEL_OPTIONS, *extra_options])


def channel(target: str, transport: Transport | None = None,
            extra_options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """An aio channel to another ringserve service, with the process's (or the given) transport
    (plus ``extra_options``)."""
    transport = transport or _transport
    options = [*transport.channel_options(), *extra_options]
    if transport.tls or transport.tls_ca_file is not None:
        return grpc.aio.secure_channel(target, transport.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(target, options=options)


def sync_channel(target: str, transport: Transport | None = None) -> grpc.Channel:
    """A blocking channel with the process's (or the given) transport (the launcher's health checks)."""
    transport = transport or _transport
    if transport.tls or transport.tls_ca_file is not None:
        return grpc.secure_channel(target, transport.channel_credentials(), options=transport.channel_options())
    return grpc.insecure_channel(target, options=transport.channel_options())


def describe_error(exc: BaseException | None) -> str:
    """"CODE: details" of a gRPC error, else the exception's repr (for log lines)."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)


async def stream_accepted(call: grpc.aio.Call, grace_s: float) -> None:
    """Wait until a server accepted a long-lived streaming ``call``: its initial metadata
    arrived (ringserve's servers send it once the stream is registered), or ``grace_s``
    passed with the call still open (a peer that does not announce).

    Raises:
        ConnectionError: the server ended the call instead (refused it: UNAUTHENTICATED,
            ALREADY_EXISTS, ...), with its status and details.
    """
    try:
        await asyncio.wait_for(call.initial_metadata(), grace_s)
    except asyncio.TimeoutError:
        pass
    if call.done():
        code = await call.code()
        raise ConnectionError(f"the peer ended the stream at once ({code.name}: {await call.details()})")


class RetryLog:
    """A tenacity ``before_sleep`` that logs why a connection attempt failed, once per cause:
    a peer that refuses (UNAUTHENTICATED, ALREADY_EXISTS) says so in the log at once instead
    of being retried in silence, and a peer that stays down does not fill the log.

    Args:
        log: where to log (WARNING).
        what: the link, e.g. "scheduler stream to 127.0.0.1:30020".
    """

    def __init__(self, log: logging.Logger, what: str) -> None:
        self.log = log
        self.what = what
        self.last: str | None = None

    def __call__(self, retry_state) -> None:
        cause = describe_error(retry_state.outcome.exception() if retry_state.outcome else None)
        if cause != self.last:
            self.last = cause
            self.log.warning("%s: attempt failed (%s); retrying", self.what, cause)

    def reset(self) -> None:
        """After a success: the next failure is logged even if its cause is the last one's."""
        self.last = None


async def wait_serving(channel: grpc.aio.Channel, service: str = "", timeout_s: float = 5.0) -> bool:
    """True if the peer's health service reports SERVING for ``service`` within ``timeout_s``."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING
