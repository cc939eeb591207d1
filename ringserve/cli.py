"""The ``ringserve`` command: one subcommand per service, plus ``launch``.

Each subcommand's module exposes ``main(argv)``; its flags are parsed there,
once, into that service's frozen config dataclass.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

# Set by ``ringserve launch`` in each service's environment: the launcher's pid.
LAUNCHER_PID_ENV = "RINGSERVE_LAUNCHER_PID"

SUBCOMMANDS = {
    "launch": ("ringserve.launch", "start all four services locally and serve the OpenAI API"),
    "gateway": ("services.gateway.main", "the OpenAI-compatible HTTP gateway"),
    "tokenizer": ("services.tokenizer.main", "the tokenizer service (public gRPC API)"),
    "scheduler": ("services.scheduler.main", "the scheduler service (model runner)"),
    "detokenizer": ("services.detokenizer.main", "the detokenizer service"),
    "bench": ("ringserve.bench.cli", "serving benchmarks: bench serve, bench compare, bench soak"),
    "health": ("ringserve.health", "exit 0 when a gRPC service reports SERVING (probes, with TLS)"),
    "prepare-model": ("ringserve.prepare", "prepare a model directory if missing (the Helm chart's init containers)"),
}


def _die_with_launcher() -> None:
    """Started by ``ringserve launch``: get SIGTERM when the launcher dies (Linux), so no
    service is orphaned.

    Done here, after exec, rather than in a ``preexec_fn``: forking a process that holds
    gRPC's threads and running Python in the child before exec can abort the child in
    gRPC's fork handlers (seen as ``epoll_wait error: Bad file descriptor``, then SIGABRT).
    """
    launcher_pid = os.environ.pop(LAUNCHER_PID_ENV, None)
    if launcher_pid is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(launcher_pid):  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="ringserve",
        description="LLM serving split into gateway, tokenizer, scheduler and detokenizer services.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv or ["--help"])
        return
    _die_with_launcher()
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    module.main(argv[1:])


if __name__ == "__main__":
    main()
