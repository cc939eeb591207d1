"""docs/api.md's table of sampling parameters is the one ``ringserve.sampling_params`` renders.

The block between the two marker comments is pasted from ``sampling_params.markdown()``
(as docs/flags.md is from the option table, tests/options/test_options.py): a parameter
added to the table, or a bound or default changed there, fails here until the page shows it.
"""

from __future__ import annotations

import re

from ringserve import sampling_params
from tests.helpers.repo import REPO

API = REPO / "docs" / "api.md"
BLOCK = re.compile(r"<!-- sampling-params:begin [^\n]*-->\n(.*?)\n<!-- sampling-params:end -->", re.S)


def docs_block(text: str) -> str:
    """The text between the markers; AssertionError when they are not there exactly once."""
    blocks = BLOCK.findall(text)
    assert len(blocks) == 1, f"{API}: expected one sampling-params block, found {len(blocks)}"
    return blocks[0]


def test_api_docs_table_is_the_generated_one() -> None:
    """Regenerate with:
    .venv/bin/python -c 'from ringserve import sampling_params; print(sampling_params.markdown())'."""
    assert docs_block(API.read_text()) == sampling_params.markdown()

