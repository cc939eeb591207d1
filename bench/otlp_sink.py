"""An OTLP/gRPC trace sink for benchmarks: accepts ``TraceService/Export`` and drops the spans.

The request bytes are not even parsed, so the sink costs the machine as little as a collector
can; the services' own cost of tracing (making spans, encoding and sending them) is all that
a traced benchmark run adds. Prints the calls and bytes it took when it stops (SIGTERM/SIGINT).

    python bench/otlp_sink.py --port 4317
"""

from __future__ import annotations

import argparse
import signal
import threading
from concurrent import futures

import grpc

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4317)
    args = p.parse_args()
    taken = {"calls": 0, "bytes": 0}
    lock = threading.Lock()

    def export(request: bytes, context: grpc.ServicerContext) -> bytes:
        with lock:
            taken["calls"] += 1
            taken["bytes"] += len(request)
        return b""  # an empty ExportTraceServiceResponse: every span accepted

    # No (de)serializers: the handler gets and returns the raw message bytes.
    handler = grpc.method_handlers_generic_handler("opentelemetry.proto.collector.trace.v1.TraceService", {
        "Export": grpc.unary_unary_rpc_method_handler(export)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"otlp sink on {args.host}:{args.port} ({EXPORT})", flush=True)
    stop.wait()
    server.stop(1)
    print(f"otlp sink: {taken['calls']} exports, {taken['bytes']} bytes of spans", flush=True)


if __name__ == "__main__":
    main()
