#!/usr/bin/env bash
# `make test`: the whole suite as two pytest sessions at once, on the tiers of
# tests/helpers/tiers.py. The ring tier (launched services, the tests with time bounds) runs in
# the foreground; the unit and model tiers (in-process engines and kernels, no launched ring)
# run beside it at nice 10, so they take the CPU the ring leaves idle and yield it whenever
# the ring's services want it. Run one after the other the suite kept about one of 2 cores
# busy (a ring's request path is one process at a time): `time make test` on a fresh clone,
# quiet 2-core Xeon, 2026-12-06: 35.2 min of wall time, 37.7 min of CPU (user + sys).
#
#   tests/run_suite.sh               # both sessions; exits non-zero if either failed
#   tests/run_suite.sh ARGS...       # one plain `pytest -q ARGS...` (a selection by hand)
#
# PY: the interpreter (default .venv/bin/python). TEST_REPORT_DIR: where each session writes
# its JUnit XML (ring.xml, unit-model.xml), when set.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if (($#)); then
  exec "$PY" -m pytest -q "$@"
fi
report=${TEST_REPORT_DIR:-}
log=$(mktemp -t ringserve-unit-model.XXXXXX.log)
nice -n 10 "$PY" -m pytest -q -m "not ring" --durations=15 ${report:+--junitxml="$report/unit-model.xml"} \
  >"$log" 2>&1 &
other=$!
trap 'kill "$other" 2>/dev/null' INT TERM
echo "ring tier here; unit and model tiers beside it at nice 10 (log: $log)"
"$PY" -m pytest -q -m ring --durations=15 ${report:+--junitxml="$report/ring.xml"}
ring_rc=$?
wait "$other"
other_rc=$?
echo
echo "================ unit and model tiers (ran beside the ring tier) ================"
cat "$log"
echo "ring tier: exit $ring_rc; unit and model tiers: exit $other_rc"
if ((ring_rc != 0)); then exit "$ring_rc"; fi
exit "$other_rc"
