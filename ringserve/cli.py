"""The ``ringserve`` command: one subcommand per service, plus ``launch``.

Each subcommand's module exposes ``main(argv)``; its flags are parsed there,
once, into that service's frozen config dataclass.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = {
    "launch": ("ringserve.launch", "start all four services locally and serve the OpenAI API"),
    "gateway": ("services.gateway.main", "the OpenAI-compatible HTTP gateway"),
    "tokenizer": ("services.tokenizer.main", "the tokenizer service (public gRPC API)"),
    "scheduler": ("services.scheduler.main", "the scheduler service (model runner)"),
    "detokenizer": ("services.detokenizer.main", "the detokenizer service"),
    "bench": ("ringserve.bench.cli", "serving benchmarks: bench serve, bench compare, bench soak"),
    "health": ("ringserve.health", "exit 0 when a gRPC service reports SERVING (probes, with TLS)"),
}


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
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    module.main(argv[1:])


if __name__ == "__main__":
    main()
