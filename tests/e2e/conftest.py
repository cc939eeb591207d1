"""A second shared ring for the structured-output, tool and reasoning cases."""

from __future__ import annotations

from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parents[2] / "ringserve" / "templates" / "chatml_tools.jinja"


@pytest.fixture(scope="session")
def tools_ring(smollm2_dir: Path):
    """SmolLM2 in fp32 with ``--chat-template ringserve/templates/chatml_tools.jinja`` (its own
    template cannot render tools), launched once for the modules that need it."""
    from tests.ringstack import launched

    with launched(smollm2_dir, "--chat-template", str(TEMPLATE)) as ring:
        yield ring
