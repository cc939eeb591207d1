"""Reading an engine's step outputs per request, and the requests the scheduler tests send."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.policy.req import FinishReason, ReqInput, SamplingParams


@dataclass
class Result:
    """Everything the engine emitted for one rid."""

    output_ids: list[int] = field(default_factory=list)
    rows: int = 0
    init_rows: list[int] = field(default_factory=list)  # step indices of rows carrying RowInit
    finish: FinishReason | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)
    top_vals: list[float] = field(default_factory=list)
    top_width: int = 0
    prompt_start: int | None = None  # prompt logprobs, once per rid
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_ids: list[int] = field(default_factory=list)
    prompt_top_vals: list[float] = field(default_factory=list)
    embedding: list[float] | None = None  # an embedding request's vector, once per rid


def collect(out, results: dict[str, Result], step: int = 0) -> None:
    """Fold one StepOutput into per-rid Results, checking the columnar layout as it goes."""
    inits = {i.row: i for i in out.inits}
    pos = lp = top = 0
    for row, rid in enumerate(out.rids):
        res = results.setdefault(rid, Result())
        n = out.new_token_counts[row]
        res.output_ids.extend(out.output_ids[pos : pos + n])
        pos += n
        res.rows += 1
        if row in inits:
            res.init_rows.append(step)
            res.top_width = inits[row].top_logprobs_num
        assert res.finish is None, f"{rid} has a row after its final row"
        res.finish = out.finish_reasons[row]
        res.completion_tokens = out.completion_tokens[row]
        res.prompt_tokens = out.prompt_tokens[row]
        res.cached_tokens = out.cached_tokens[row]
        k = out.logprob_counts[row]
        res.logprobs.extend(out.output_token_logprobs[lp : lp + k])
        lp += k
        width = k * res.top_width
        res.top_ids.extend(out.top_logprob_ids[top : top + width])
        res.top_vals.extend(out.top_logprob_vals[top : top + width])
        top += width
    assert (pos, lp, top) == (len(out.output_ids), len(out.output_token_logprobs), len(out.top_logprob_ids))
    for p in out.prompt_logprobs:
        res = results[out.rids[p.row]]
        assert res.prompt_start is None, "prompt logprobs are sent once"
        assert len(p.top_ids) == len(p.top_vals) == p.top_n * len(p.logprobs)
        res.prompt_start = p.start
        res.prompt_logprobs, res.prompt_top_ids, res.prompt_top_vals = p.logprobs, p.top_ids, p.top_vals
    for e in out.embeddings:
        res = results[out.rids[e.row]]
        assert res.embedding is None, "an embedding is sent once"
        assert out.finish_reasons[e.row] is not None, "an embedding comes with its request's final row"
        res.embedding = e.values


def greedy(rid: str, ids: list[int], max_new_tokens: int = 16, **kw) -> ReqInput:
    """A greedy request."""
    return ReqInput(rid=rid, input_ids=ids,
                    sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kw))
