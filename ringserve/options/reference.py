"""docs/flags.md: every command's flags, rendered from the parsers the table generates."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ringserve.options.launch import LaunchOptions, LaunchParser
from ringserve.options.parse import ConfigParser, Placed
from ringserve.options.spec import REQUIRED
from ringserve.options.table import SERVICES

HEADER = """\
# Flags

Every flag of `ringserve launch` and of each service, generated from the option table in
`ringserve/options/` (`python -m ringserve.options --markdown > docs/flags.md`; a test checks
that this file is current). To add an option, declare it once there: each service's
parser, its config field, the launcher's pass-through and this page follow.

`ringserve launch` has its own flags (ports, instance counts, what each replica gets) and
passes the others on to the services named before their help, when given a value other
than the default. On Kubernetes the Helm chart sets them (`deploy/helm/ringserve`).
"""

ORDER = ("gateway", "tokenizer", "scheduler", "detokenizer")


def _cell(text: str) -> str:
    """Table-safe: no pipes, no tags a Markdown renderer would swallow (``<think>``)."""
    return text.replace("|", "\\|").replace("<", "&lt;")


def _default(action: argparse.Action) -> str:
    value: Any = action.default
    if action.required or value is REQUIRED:
        return "required"
    if value is None or value is False or value == [] or isinstance(action, argparse._StoreConstAction):
        return ""
    # The launcher's model lives under the home of whoever renders this page.
    return f"`{str(value).replace(str(Path.home()), '~')}`"


def _values(action: argparse.Action, checks: dict[str, str]) -> str:
    if action.choices:
        return ", ".join(f"`{c}`" for c in action.choices)
    return _cell(checks.get(action.option_strings[0], ""))


def table(parser: argparse.ArgumentParser, placed: list[Placed], prefixes: dict[str, str] | None = None) -> str:
    """One Markdown table: flag, default, values allowed, meaning (the option's help without
    the default ``--help`` appends; ``prefixes``: text before a flag's help)."""
    checks = {p.option.flag: p.option.check.describe() for p in placed if p.option.check is not None}
    meanings = {p.option.flag: (prefixes or {}).get(p.option.flag, "") + p.option.help for p in placed}
    rows = ["| flag | default | values | meaning |", "|---|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = ", ".join(action.option_strings)
        if action.metavar and not action.choices:
            flag += f" {action.metavar}"
        meaning = meanings.get(action.option_strings[0], action.help or "")
        rows.append(f"| `{flag}` | {_default(action)} | {_values(action, checks)} | {_cell(meaning)} |")
    return "\n".join(rows)


def markdown() -> str:
    """The whole of docs/flags.md."""
    launch = LaunchParser(LaunchOptions)
    prefixes = {p.option.flag: f"{', '.join(p.services)}: " for p in launch.passed}
    sections = [HEADER, "## ringserve launch\n\n"
                + table(launch.parser, launch.placed + [p.placed for p in launch.passed], prefixes)]
    for service in ORDER:
        cli = ConfigParser(SERVICES[service], prog=f"ringserve {service}")
        sections.append(f"## ringserve {service}\n\n" + table(cli.parser, cli.placed))
    return "\n\n".join(sections) + "\n"
