"""Compile every Triton kernel ringserve ships for sm_80 and sm_90, here, without a GPU, and print
each one's shared memory, registers and spills beside the GPU's limits (``services.scheduler.triton_aot``).

Usage (from the repo root; no GPU, no TRITON_INTERPRET)::

    .venv/bin/python bench/triton_aot.py [--json out.json] [--results-md bench/RESULTS.md] [--kernel NAME]

Compiles into a fresh Triton cache directory of its own (so every kernel is really compiled),
deleted at exit. Exits 1 when a kernel does not compile, exceeds a limit, or a shipped kernel
is launched by no step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ringserve.models import SMOLLM2_DIR  # noqa: E402


def _constexprs(c) -> dict:
    return {k: v for k, v in c.constexprs.items() if k != "UPCAST"}  # True only under the interpreter


def _label(c) -> str:
    return f"{c.kernel} {c.target} {c.dtype} {_constexprs(c)}"


def _row(c) -> dict:
    return {"kernel": c.kernel, "target": c.target, "dtype": c.dtype, "constexprs": _constexprs(c),
            "models": _models(c.sources),
            "num_warps": c.num_warps, "num_stages": c.num_stages, "shared": c.shared, "registers": c.registers,
            "spill_stores": c.spill_stores, "spill_loads": c.spill_loads, "stack": c.stack,
            "seconds": round(c.seconds, 2), "cpu_seconds": round(c.cpu_seconds, 2), "error": c.error}


def _models(sources: list[str]) -> list[str]:
    return sorted({s.split(" ")[0] for s in sources})


def markdown(report: dict) -> str:
    """The report as a Markdown table, one row per kernel x target x specialization."""
    lines = ["| kernel | target | dtype | constexprs | models | warps | shared (B) | regs | spills (B st/ld) "
             "| compile (CPU s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["compiled"]:
        consts = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in r["constexprs"].items())
        spills = f"{r['spill_stores']}/{r['spill_loads']}" if r["spill_stores"] or r["spill_loads"] else "0"
        lines.append(f"| {r['kernel']} | {r['target']} | {r['dtype']} | {consts} | {', '.join(r['models'])} | "
                     f"{r['num_warps']} | {r['shared']} | {r['registers']} | {spills} | {r['cpu_seconds']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("RINGSERVE_CACHE_DIR",
                                                                          Path.home() / ".cache" / "ringserve")))
    p.add_argument("--smollm2", type=Path, help="the packaged SmolLM2 model directory (default: in --cache-dir)")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                   help="compile in this many processes (default: up to 2; each compile holds one core)")
    p.add_argument("--kernel", default="", help="compile only kernels whose name holds this")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--results-md", type=Path, help="append the table to this Markdown file")
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        p.error("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="triton-aot-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # read by triton when it first needs its cache
        from services.scheduler.triton_aot.compiler import TARGETS, compile_all, cpu_seconds, specialize
        from services.scheduler.triton_aot.launches import models, record, unlaunched

        shapes = models(a.smollm2 or a.cache_dir / "models" / SMOLLM2_DIR)
        calls = record(shapes)
        missing = unlaunched(calls)
        work = [(launch, t) for t in TARGETS for launch in specialize(calls, t) if a.kernel in launch.name]
        # The slowest first (attention), so that the pool does not end on one long compile.
        work.sort(key=lambda w: "attention" not in w[0].kernel.__module__)
        recorded, recorded_cpu = time.perf_counter() - started, time.process_time()
        compiled = compile_all(work, a.workers)
    limits = {t.name: t for t in TARGETS}
    over = {_label(c): c.over_limits(limits[c.target]) for c in compiled}
    report = {"targets": {t.name: {"gpus": t.gpus, "shared_per_block": t.shared_per_block} for t in TARGETS},
              "models": sorted(shapes), "unlaunched": missing, "compiled": [_row(c) for c in compiled],
              "over_limits": {k: v for k, v in over.items() if v},
              "spills": sorted(_label(c) for c in compiled if c.spill_stores or c.spill_loads),
              "record_s": round(recorded, 1), "record_cpu_s": round(recorded_cpu, 1),
              "wall_s": round(time.perf_counter() - started, 1), "cpu_s": round(cpu_seconds(), 1)}
    print(markdown(report))
    print(f"{len(compiled)} compiles ({len(work) // len(TARGETS)} specializations x {len(TARGETS)} targets) in "
          f"{report['wall_s']} s wall ({report['record_s']} s recording), {report['cpu_s']} s CPU "
          f"({report['record_cpu_s']} s recording); "
          f"over a limit: {len(report['over_limits'])}; spilling: {len(report['spills'])}; "
          f"unlaunched kernels: {report['unlaunched'] or 'none'}")
    for name, why in report["over_limits"].items():
        print(f"OVER LIMIT {name}: {'; '.join(why)}")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    if a.results_md:
        with a.results_md.open("a") as f:
            f.write(markdown(report))
    return 1 if report["over_limits"] or report["unlaunched"] else 0


if __name__ == "__main__":
    sys.exit(main())
