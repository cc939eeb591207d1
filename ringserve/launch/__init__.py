"""``ringserve launch``: run the whole ring locally as separate processes.

Starts the detokenizer, the scheduler, the tokenizer and the gateway as
separate processes on loopback, in that order (each one connects only to
services already started), waits until each reports SERVING on the standard
gRPC health service (the gateway: ``GET /health`` = 200), prints the URL and
each service's address and PID, and stops them all on Ctrl-C or SIGTERM.

``--replicas M`` starts M model replicas (each a scheduler with its own
detokenizer; with ``--tp-size N`` each scheduler is rank 0 of N and starts the other ranks
itself, so replica i takes cuda:i*N..cuda:i*N+N-1 when ``--device cuda``) and
``--tokenizers N`` N tokenizer instances, each talking to every replica; the gateway
balances over the tokenizers with gRPC's round_robin. The port flags set the first
instance's port; the others get free ports.

Ports: the gateway's HTTP port (``--port``, 8000) and the public gRPC API, the first
tokenizer's port (``--tokenizer-port``, 30010, as in the Helm chart), are fixed by default;
the internal ones are free loopback ports unless given. Every fixed port is checked before
anything starts or any model is prepared: a port in use ends the launch at once with a
message that names it and the flag that moves it.

Stopping is graceful and follows the request path: the gateway first (it stops
accepting and finishes its open responses), then the tokenizer, the scheduler
and the detokenizer, each given ``--grace-period`` seconds (plus a margin) to
exit before it is killed. If a service exits on its own, the others are stopped
and the launcher exits with status 1 — unless ``--restart-on-failure``, which
starts it again with the same flags and port (the tokenizer and the scheduler
reconnect to it with backoff).

API keys (``--api-key``, ``--api-key-file``, ``$RINGSERVE_API_KEY``) go to the gateway and
every tokenizer through the environment (``RINGSERVE_API_KEY``), never on their command
lines: the gateway requires one on its HTTP API and presents the first to the tokenizer,
which requires one on its public gRPC service.

Internal links are authenticated by default: the launcher generates a per-ring token
(``ringserve.internal_auth``; or takes ``--internal-token-file``/``$RINGSERVE_INTERNAL_TOKEN``)
and hands it to the detokenizers, schedulers and tokenizers in the environment
(``RINGSERVE_INTERNAL_TOKEN``); it is never printed. ``--insecure-skip-internal-auth``
passes that flag on instead.

Every service gets the same gRPC transport flags (``--grpc-max-message-bytes``, and
``--tls-cert-file/--tls-key-file/--tls-ca-file`` for TLS or mutual TLS); the launcher's own
health checks use them too.
"""

from ringserve.launch.flags import LaunchConfig, parse_args
from ringserve.launch.launcher import Launcher
from ringserve.launch.processes import grpc_serving, service_pid, service_processes, stop_launched, wait_launched
from ringserve.launch.run import main

# free_port and free_ports are imported from here by tests and benchmarks.
from ringserve.ports import free_port, free_ports

__all__ = ["LaunchConfig", "Launcher", "free_port", "free_ports", "grpc_serving", "main", "parse_args", "service_pid",
           "service_processes", "stop_launched", "wait_launched"]
