"""``ringserve health ADDRESS``: exit 0 when a ringserve gRPC service reports SERVING, else 1.

The standard gRPC health check with the services' transport flags, for probes that must
speak TLS (Kubernetes' own gRPC probes cannot) and for scripts. ``--service liveness``
asks whether the process is alive, whatever its peers do (``grpcutil.LIVENESS``).
"""

from __future__ import annotations

import argparse
import sys

from ringserve import grpcutil
from ringserve.launch import grpc_serving


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="ringserve health", description=__doc__.splitlines()[0])
    p.add_argument("address", help="host:port of the service, e.g. localhost:30010")
    p.add_argument("--timeout", type=float, default=4.0, help="seconds (default %(default)s)")
    p.add_argument("--service", default="",
                   help="health service name: '' (default) = ready, 'liveness' = the process is alive")
    grpcutil.add_transport_args(p)
    a = p.parse_args(argv)
    sys.exit(0 if grpc_serving(a.address, grpcutil.transport_from_args(p, a), a.timeout, a.service) else 1)


if __name__ == "__main__":
    main()
