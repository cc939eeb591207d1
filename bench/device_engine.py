"""An engine built in-process on a device, and its outputs, for the GPU check's parts
(``bench/gpu_check.py``, ``bench/gpu_features.py``)."""

from __future__ import annotations

from pathlib import Path

from services.scheduler.config import EngineConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.policy.req import ReqInput


def make_engine(model_dir: Path, device: str, dtype: str, **kw) -> Engine:
    """An engine on ``device``: 16384 KV tokens and 16 running requests unless ``kw`` says
    otherwise; any other ``EngineConfig`` field through ``kw``."""
    cfg = EngineConfig(model=model_dir, device=device, dtype=dtype, max_total_tokens=kw.pop("max_total_tokens", 16384),
                       max_running_requests=kw.pop("max_running_requests", 16), **kw)
    return Engine.from_config(cfg)


def run_outputs(engine: Engine, reqs: list[ReqInput]) -> dict[str, tuple[list[int], list[float]]]:
    """Add ``reqs`` and step ``engine`` until idle -> rid -> (output ids, their logprobs; empty
    unless the request asked for them)."""
    for req in reqs:
        engine.add_request(req)
    got: dict[str, tuple[list[int], list[float]]] = {}
    while engine.has_work:
        out = engine.step()
        if out is None:
            continue
        pos = lp = 0
        for row, rid in enumerate(out.rids):
            n, k = out.new_token_counts[row], out.logprob_counts[row]
            ids, lps = got.setdefault(rid, ([], []))
            ids.extend(out.output_ids[pos : pos + n])
            lps.extend(out.output_token_logprobs[lp : lp + k])
            pos, lp = pos + n, lp + k
    return got
