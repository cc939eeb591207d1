"""``ringserve bench serve|compare|soak``."""

from __future__ import annotations

import argparse
import importlib

COMMANDS = {
    "serve": ("ringserve.bench.serve",
              "load an OpenAI-compatible server (SGLang bench_serving / vLLM bench serve style)"),
    "compare": ("ringserve.bench.compare", "ringserve against the baselines, one table (make bench)"),
    "soak": ("ringserve.bench.soak", "a bounded soak run with disconnects and a scheduler kill (make soak)"),
}


def main(argv: list[str] | None = None) -> None:
    argv = list(argv or [])
    if not argv or argv[0] not in COMMANDS:
        p = argparse.ArgumentParser(prog="ringserve bench")
        sub = p.add_subparsers(dest="command", metavar="COMMAND")
        for name, (_, help_text) in COMMANDS.items():
            sub.add_parser(name, help=help_text)
        p.parse_args(argv or ["--help"])
        return
    importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
