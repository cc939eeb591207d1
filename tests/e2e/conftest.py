"""A second shared ring for the structured-output, tool and reasoning cases."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.ringstack import launched
from tests.helpers.tiers import ring_fixture

TEMPLATE = Path(__file__).resolve().parents[2] / "ringserve" / "templates" / "chatml_tools.jinja"


@ring_fixture(scope="session")
def tools_ring(smollm2_dir: Path):
    """SmolLM2 in fp32 with ``--chat-template ringserve/templates/chatml_tools.jinja`` (its own
    template cannot render tools), launched once for the modules that need it; the last test
    of a session (tests/e2e/test_launcher_orphans.py) SIGKILLs its launcher."""
    with launched(smollm2_dir, "--chat-template", str(TEMPLATE)) as ring:
        yield ring
