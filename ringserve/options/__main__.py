"""``python -m ringserve.options --markdown``: print docs/flags.md, the flag reference."""

from __future__ import annotations

import argparse

from ringserve.options.reference import markdown

parser = argparse.ArgumentParser(prog="python -m ringserve.options", description=__doc__.splitlines()[0])
parser.add_argument("--markdown", action="store_true", required=True, help="print the flag reference (Markdown)")
parser.parse_args()
print(markdown(), end="")
