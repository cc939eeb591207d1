"""Values of every sampling parameter for table-driven tests, derived from ``ringserve.sampling_params``:
one inside its range (not its default), and those outside it. A parameter added to the table is
tested at every entry point with no test written for it here."""

from __future__ import annotations

from ringserve.sampling_params import TABLE, Param
from ringserve.v1 import common_pb2


def inside(p: Param) -> bool | int | float:
    """A valid value other than the default, exact in float32 (what the proto carries)."""
    if p.type is bool:
        return not p.default
    if p.type is int:
        return p.lo + 1 if p.lo is not None else 1
    lo, hi = p.lo if p.lo is not None else -2.0, p.hi if p.hi is not None else 2.0
    return float(lo + (hi - lo) / 4)


def outside(p: Param, proto: bool = False) -> list[int | float]:
    """Invalid values: just past each bound, the gap below ``lo`` of a parameter with an ``off``
    value, and NaN for floats. ``proto``: only values a proto field of its type can carry."""
    if p.type is bool:
        return []
    step = 1 if p.type is int else 0.5
    bad: list[int | float] = []
    if p.lo is not None:
        below = p.lo if p.lo_open else p.lo - step
        if below != p.off:
            bad.append(below)
        if p.off is not None:
            bad.append(p.off - step)
    if p.hi is not None:
        bad.append(p.hi if p.hi_open else p.hi + step)
    if p.type is float:
        bad = [float(v) for v in bad] + [float("nan")]
    return [v for v in bad if _fits_proto(p, v)] if proto else bad


def _fits_proto(p: Param, value: int | float) -> bool:
    try:
        setattr(common_pb2.SamplingParams(), p.name, value)  # int32 / uint64 ranges
    except ValueError:
        return False
    return True


NUMERIC = [p for p in TABLE if p.type is not bool]
