"""How many cores the scheduler may use (its thread counts start from it)."""

from __future__ import annotations

import os
from pathlib import Path


def usable_cpus(cgroup_dir: Path = Path("/sys/fs/cgroup")) -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota
    (``cpu.max``, rounded up) when one is set. A Kubernetes CPU limit shows only there:
    the affinity of a pod on a 64-core node is 64 cores even under a 4-CPU limit, and
    64 OpenMP threads on a 4-CPU quota are throttled, not faster."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = (cgroup_dir / "cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (FileNotFoundError, PermissionError, ValueError):
        pass  # no cgroup v2 CPU controller here: the affinity stands
    return cpus
