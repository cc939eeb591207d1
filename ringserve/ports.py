"""Ports of a launched ring: free loopback ports for the internal services, and the check
that every fixed port is free before anything starts (``ringserve launch``).

Standard library only: ``make run`` runs ``python -m ringserve.ports`` with the system Python
before its setup, so a taken port fails at once on a fresh clone too.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
from collections.abc import Mapping

DEFAULT_PORT = 8000  # the gateway's HTTP port
DEFAULT_GRPC_PORT = 30010  # the public gRPC API (the first tokenizer), as the Helm chart's ports.tokenizer


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    return free_ports(1)[0]


def free_ports(count: int, exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1, free right now and not in ``exclude``.

    The sockets stay bound until all are picked: asking one at a time, the kernel may hand
    the same ephemeral port out twice once the first socket is closed (seen: two schedulers
    given one port, and the tokenizer refusing the duplicate address)."""
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port not in exclude and port not in ports:
                ports.append(port)
    finally:
        for s in held:
            s.close()
    return ports


class PortInUse(RuntimeError):
    """A port the launcher was told to use cannot be bound."""


# Fixed-port flags: (LaunchConfig field, flag, what listens there, make run's variable).
PORT_FLAGS = (
    ("port", "--port", "gateway HTTP", "PORT"),
    ("tokenizer_port", "--tokenizer-port", "tokenizer gRPC API", "GRPC_PORT"),
    ("scheduler_port", "--scheduler-port", "scheduler gRPC", None),
    ("detokenizer_port", "--detokenizer-port", "detokenizer gRPC", None),
    ("tokenizer_metrics_port", "--tokenizer-metrics-port", "tokenizer metrics", None),
    ("scheduler_metrics_port", "--scheduler-metrics-port", "scheduler metrics", None),
    ("detokenizer_metrics_port", "--detokenizer-metrics-port", "detokenizer metrics", None),
)


def _bindable(host: str, port: int) -> OSError | None:
    """None when a listening socket could bind ``host:port`` now, else the bind error.

    SO_REUSEADDR as the servers set it (uvicorn, gRPC), so a port in TIME_WAIT counts as
    free; without SO_REUSEPORT, so a port another server holds with it counts as taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc
    return None


def check_ports(host: str, ports: Mapping[str, int]) -> None:
    """Check every fixed port before anything starts: each distinct and free where its
    service binds it (the gateway on ``host``, the gRPC services and their metrics on
    127.0.0.1). ``ports`` maps LaunchConfig field names (``PORT_FLAGS``) to ports; 0 or
    absent: a free port picked later, not checked.

    Raises:
        PortInUse: naming the port, what would listen there, and the flag that moves it
            (and ``make run``'s variable for the two it exposes).
    """
    seen: dict[int, str] = {}
    for field_name, flag, what, make_var in PORT_FLAGS:
        port = ports.get(field_name, 0)
        if not port:
            continue
        move = f"{flag} N" + (f" (make run: {make_var}=N)" if make_var else "")
        if port in seen:
            raise PortInUse(f"port {port} is given to both {seen[port]} and {flag}; move one with {move}")
        seen[port] = flag
        bind_host = host if field_name == "port" else "127.0.0.1"
        error = _bindable(bind_host, port)
        if error is not None:
            reason = "already in use" if error.errno == errno.EADDRINUSE else error.strerror
            raise PortInUse(f"port {port} ({what}, {flag}) on {bind_host} is {reason}; choose another with {move}")


def main(argv: list[str] | None = None) -> None:
    """``python -m ringserve.ports [--host H] [--port P] [--tokenizer-port G]``: exit 1 with
    the launcher's message when either port is taken (make run's first step)."""
    parser = argparse.ArgumentParser(prog="python -m ringserve.ports", description=(main.__doc__ or "").split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--tokenizer-port", type=int, default=DEFAULT_GRPC_PORT)
    args = parser.parse_args(argv)
    try:
        check_ports(args.host, {"port": args.port, "tokenizer_port": args.tokenizer_port})
    except PortInUse as exc:
        sys.exit(f"ringserve launch: {exc}")


if __name__ == "__main__":
    main()
