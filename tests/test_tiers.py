"""The tier each test gets at collection (tests/helpers/tiers.py), for tests whose tier is known:
a fake named like a ring is still ``unit``, a ring reached through another fixture is
``ring``, an explicit mark wins over the fixtures, and the tests that end a session ring run
after all others; a test outside the ring tier that launches a ring fails."""

from __future__ import annotations

import pytest

from tests.helpers.repo import REPO
from tests.helpers.tiers import refuse_unmarked_launch

KNOWN = {
    # The gateway's own `stack` fixture is a fake tokenizer, not the session ring.
    "tests/gateway/test_gateway_errors.py::test_api_key": "unit",
    # The tokenizer service in-process with fake peers, on SmolLM2's vocabulary.
    "tests/tokenizer/test_servicer.py::test_serving_hello_and_unary_calls": "model",
    "tests/scheduler/test_radix_cache.py::test_match_splits_edges_and_returns_rows": "unit",
    "tests/scheduler/test_radix_cache.py::test_repeated_prompt_reuses_all_but_its_last_token": "model",
    "tests/scheduler/test_policy_plans.py::test_an_unknown_policy_is_refused": "unit",
    "tests/e2e/test_api_keys.py::test_gateway_passes_the_key": "ring",
    # stack, through the module's own `ring` fixture.
    "tests/e2e/test_cases_structured.py::test_abort_of_a_constrained_stream_releases_everything": "ring",
    "tests/e2e/test_launcher_orphans.py::test_kv_memory_share_is_split_over_replicas": "unit",
    "tests/e2e/test_launcher_orphans.py::test_ctrl_c_stops_a_launcher_started_with_sigint_ignored": "ring",
    # Marked: it uses smollm2_dir, but `ringserve bench soak` launches a ring.
    "tests/bench/test_soak.py::test_short_soak_with_a_scheduler_kill_ends_at_baseline": "ring",
    "tests/bench/test_soak.py::test_report_fails_on_a_gauge_off_baseline_or_a_hung_request": "unit",
}


class Collected:
    """Records each collected test's tier markers, in run order."""

    def __init__(self) -> None:
        self.tiers: dict[str, list[str]] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.tiers = {item.nodeid: [m.name for m in item.iter_markers() if m.name in ("unit", "model", "ring")]
                      for item in items}


def test_known_tests_get_their_tier_and_ring_enders_run_last(monkeypatch):
    monkeypatch.chdir(REPO)
    collected = Collected()
    files = sorted({nodeid.split("::")[0] for nodeid in KNOWN})
    assert pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *files], plugins=[collected]) == 0
    assert {nodeid: collected.tiers[nodeid] for nodeid in KNOWN} == {nodeid: [tier] for nodeid, tier in KNOWN.items()}
    order = list(collected.tiers)
    enders = [n for n in order if n.startswith("tests/e2e/test_launcher_orphans.py::test_") and
              ("killed" in n or "ctrl_c" in n)]
    assert order[-2:] == enders and len(enders) == 2


def test_a_launch_outside_the_ring_tier_is_refused(request):
    assert request.node.get_closest_marker("unit") is not None
    refuse_unmarked_launch(request.node, 3, 3)  # nothing launched
    with pytest.raises(pytest.UsageError, match=r"test_tiers.py::test_a_launch_outside_the_ring_tier_is_refused "
                                                r"launched a ring but is not in the ring tier"):
        refuse_unmarked_launch(request.node, 3, 4)
