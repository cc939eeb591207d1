"""Prompt logprobs, computed during prefill: what scoring harnesses such as
lm-eval's loglikelihood need, ``echo`` + ``logprobs`` in OpenAI's completions, vLLM's
``prompt_logprobs`` and SGLang's ``logprob_start_len``.

The logits at prompt position ``q`` score the prompt token at ``q + 1``: a request asking
from position ``s`` needs the hidden states of positions ``max(1, s) - 1 .. prompt_len - 2``
of its extend. The engine names those packed token rows on the plan
(``Plan.logprob_rows``); the model runner keeps their hidden states
(``Plan.logprob_hidden``, at most one chunk of rows: ``chunked_prefill_size`` bounds the
memory, not the prompt length); here they go through the LM head ``LOGITS_SLICE`` rows at
a time (a slice of ``[256, vocab]`` float32 logits, 50 MB for a 49k vocabulary), and
each request keeps its log-softmax of the target tokens (and top-k) until its first
sampled token carries them out.

Prefix cache: a cached position has no hidden state, so the scheduler matches the cache
only up to ``prompt_logprob_pos - 1`` (``SchedulePolicy._match``): the range asked for is
recomputed, the part before it still comes from the cache. After a retraction the same
rule resumes from the first position not computed yet, so no logprob is sent twice.

The values are the log-softmax of the model's raw logits (no temperature, penalties or
bias: the model's own distribution, as vLLM and SGLang report prompt logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.scheduler.executor.device import DeviceRuntime
from services.scheduler.executor.sampling import top_logprobs
from services.scheduler.models.base import CausalLM
from services.scheduler.policy.req import Req
from services.scheduler.policy.schedule import Plan

LOGITS_SLICE = 256


@dataclass(frozen=True)
class Span:
    """``count`` consecutive prompt logprobs of ``req``, from its ``prompt_logprob_pos``."""

    req: Req
    count: int


def plan_logprob_rows(plan: Plan) -> list[Span]:
    """Set ``plan.logprob_rows`` (int64 [R], packed token indices) to the extend rows whose
    logits score a prompt token asked for; return which request each run of rows is for."""
    rows: list[int] = []
    spans: list[Span] = []
    offset = 0
    e = plan.num_extend
    for req, prefix, n in zip(plan.reqs[:e], plan.prefix_lens[:e], plan.extend_lens[:e], strict=True):
        if req.prompt_logprob_pos < req.prompt_len:
            lo = req.prompt_logprob_pos - 1  # >= prefix: the cache stopped before it
            hi = min(prefix + n, req.prompt_len - 1)
            if hi > lo >= prefix:
                rows.extend(range(offset + lo - prefix, offset + hi - prefix))
                spans.append(Span(req, hi - lo))
        offset += n
    plan.logprob_rows = torch.tensor(rows, dtype=torch.int64) if rows else None
    return spans


def score_prompts(model: CausalLM, runtime: DeviceRuntime, plan: Plan, spans: list[Span]) -> None:
    """Log-softmax of each span's target prompt tokens from ``plan.logprob_hidden``
    ([R, hidden] on the device, set by the model runner), appended to each request's prompt
    logprobs. The targets go to the device in one copy and the results come back in one
    copy each (chosen, and with top-k its values and ids), through the runtime."""
    if not spans:
        return
    hidden = plan.logprob_hidden
    ids = [t for s in spans for t in s.req.origin_input_ids[s.req.prompt_logprob_pos :][: s.count]]
    targets = runtime.to_device(torch.tensor(ids, dtype=torch.int64))  # [R]
    k = max(s.req.prompt_top_logprobs_num for s in spans)
    vals: list[torch.Tensor] = []
    tops: list[tuple[torch.Tensor, torch.Tensor]] = []
    rows = hidden.shape[0]
    for a in range(0, rows, LOGITS_SLICE):
        n = min(LOGITS_SLICE, rows - a)
        logp = torch.log_softmax(model.compute_logits(hidden.narrow(0, a, n)), dim=-1)  # [S, V] fp32
        vals.append(logp.gather(1, targets.narrow(0, a, n).unsqueeze(1)).squeeze(1))
        if k:
            tops.append(top_logprobs(logp, k))
    chosen = runtime.to_host(torch.cat(vals)).tolist()
    top_vals = runtime.to_host(torch.cat([v for v, _ in tops])).tolist() if k else None
    top_ids = runtime.to_host(torch.cat([i for _, i in tops])).tolist() if k else None
    at = 0
    for s in spans:
        req, kk = s.req, s.req.prompt_top_logprobs_num
        req.prompt_logprobs.extend(chosen[at : at + s.count])
        if kk:
            for j in range(at, at + s.count):
                req.prompt_top_ids.extend(top_ids[j][:kk])
                req.prompt_top_vals.extend(top_vals[j][:kk])
        req.prompt_logprob_pos += s.count
        at += s.count
    plan.logprob_hidden = None
