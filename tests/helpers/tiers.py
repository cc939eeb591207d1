"""The suite's three tiers, and how a test's tier follows from the fixtures it uses.

- ``unit``: neither a prepared model nor a launched ring (fakes, tiny models, parsers);
  ``make test-unit`` runs these.
- ``model``: reads a prepared model or vocabulary from the cache (weights, tokenizer.json),
  launches nothing.
- ``ring``: launches services (a ring, or a server of its own).

A fixture that launches a ring is declared with ``ring_fixture``, one that hands out a
prepared model or vocabulary with ``model_fixture``; a test using one of them, directly or
through another fixture, is in that tier (ring over model), every other test is ``unit``.
A test whose tier its fixtures do not show (it starts a server in its body, or reads the
cache without a fixture) carries ``pytest.mark.ring`` / ``pytest.mark.model`` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest

TIERS = ("unit", "model", "ring")


def _tier_fixture(tier: str, **fixture_kwargs: Any) -> Callable:
    def declare(func: Callable) -> Any:
        func.tier = tier  # read back by ``tier_of`` from the fixture's definition
        return pytest.fixture(**fixture_kwargs)(func)

    return declare


def ring_fixture(**fixture_kwargs: Any) -> Callable:
    """``pytest.fixture(**fixture_kwargs)`` for a fixture that launches a ring (tier ``ring``)."""
    return _tier_fixture("ring", **fixture_kwargs)


def model_fixture(**fixture_kwargs: Any) -> Callable:
    """``pytest.fixture(**fixture_kwargs)`` for a fixture that hands out a prepared model or
    vocabulary (tier ``model``)."""
    return _tier_fixture("model", **fixture_kwargs)


def tier_of(item: pytest.Item) -> str:
    """The tier of a collected test: its own tier marker, else the highest tier among the
    fixtures it uses (their definitions as this test sees them), else ``unit``.

    Raises:
        pytest.UsageError: the test carries more than one tier marker.
    """
    marked = {m.name for m in item.iter_markers() if m.name in TIERS}
    if len(marked) > 1:
        raise pytest.UsageError(f"{item.nodeid}: more than one tier marker: {sorted(marked)}")
    if marked:
        return marked.pop()
    info = getattr(item, "_fixtureinfo", None)
    defs: Iterable = info.name2fixturedefs.values() if info is not None else ()
    # The last definition of a name is the one this test gets (a closer conftest or module overrides).
    used = {getattr(fixturedefs[-1].func, "tier", "unit") for fixturedefs in defs if fixturedefs}
    return max(used | {"unit"}, key=TIERS.index)


def refuse_unmarked_launch(item: pytest.Item, launches_before: int, launches_after: int) -> None:
    """Fail ``item`` if rings were launched while it set up or ran (``ringstack.launches``
    moved) and it is not in the ring tier: a fixture that launches one was declared without
    ``ring_fixture``, or the test launches one itself unmarked, and ``-m unit`` would run it.

    Raises:
        pytest.UsageError: naming the test and the two ways to declare it.
    """
    if launches_after != launches_before and item.get_closest_marker("ring") is None:
        raise pytest.UsageError(f"{item.nodeid} launched a ring but is not in the ring tier: declare its ring "
                                "fixture with ring_fixture (tests/helpers/tiers.py) or mark it pytest.mark.ring")
