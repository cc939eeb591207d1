"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, penalties, logit bias, seeds.

The filter order follows SGLang's sampler: temperature scaling, softmax, then top-k,
top-p (nucleus, Holtzman et al. 2019) and min-p (Nguyen et al. 2024) on the sorted
probabilities, renormalized. The draw is the exponential race ``argmax(p / E)``,
``E ~ Exp(1)`` (equivalent to the Gumbel-max trick), which lets each seeded request take
its noise from its own ``torch.Generator`` while the arithmetic stays batched.
Everything runs in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.scheduler.engine.req import Req


@dataclass
class SampleResult:
    """Chosen token ids and, for rows that asked, their logprobs.

    Attributes:
        next_ids: int64 [B].
        logprobs: float32 [B], log-probability of the chosen token under the processed
            distribution (after bias, temperature and filters); None if no row asked.
        top_ids / top_vals: int64 / float32 [B, K] with K the batch's largest
            top_logprobs_num; None when K is 0.
    """

    next_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_vals: torch.Tensor | None = None


class Sampler:
    """Samples one token per row of a logits batch. Unseeded rows share ``generator``."""

    def __init__(self, seed: int | None = None, eos_ids: frozenset[int] = frozenset()):
        self.eos_ids = eos_ids
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> SampleResult:
        """logits: float32 [B, V], row i belongs to reqs[i] -> SampleResult."""
        logits = _apply_penalties(_apply_logit_bias(logits, reqs), reqs)
        logits = self._ban_stops_before_min_tokens(logits, reqs)
        params = [r.sampling for r in reqs]
        greedy = [p.temperature == 0.0 for p in params]
        want_logprob = any(r.return_logprob for r in reqs)
        if all(greedy):
            next_ids = logits.argmax(dim=-1)
            logp = torch.log_softmax(logits, dim=-1) if want_logprob else None
        else:
            temps = torch.tensor([p.temperature or 1.0 for p in params], dtype=torch.float32)
            probs = torch.softmax(logits / temps[:, None], dim=-1)
            probs = _filter(probs, params)
            noise = self._exponential(probs.shape, reqs)
            next_ids = (probs / noise).argmax(dim=-1)
            if any(greedy):
                mask = torch.tensor(greedy)
                next_ids = torch.where(mask, logits.argmax(dim=-1), next_ids)
            logp = None
            if want_logprob:
                logp = torch.log(probs)
                if any(greedy):
                    logp = torch.where(mask[:, None], torch.log_softmax(logits, dim=-1), logp)
        result = SampleResult(next_ids)
        if logp is not None:
            result.logprobs = logp.gather(1, next_ids[:, None]).squeeze(1)
            k = max(r.top_logprobs_num for r in reqs)
            if k > 0:
                result.top_vals, result.top_ids = logp.topk(k, dim=-1)
        return result

    def _ban_stops_before_min_tokens(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """Below min_new_tokens, EOS (unless ignore_eos) and stop token ids cannot be sampled (as vLLM's min_tokens)."""
        rows = [(i, r) for i, r in enumerate(reqs) if len(r.output_ids) < r.sampling.min_new_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i, r in rows:
            banned = set(r.sampling.stop_token_ids) | (set() if r.sampling.ignore_eos else set(self.eos_ids))
            if banned:
                logits[i, list(banned)] = float("-inf")
        return logits

    def _exponential(self, shape: torch.Size, reqs: list[Req]) -> torch.Tensor:
        noise = torch.empty(shape, dtype=torch.float32).exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        return noise


def _apply_logit_bias(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    rows = [(i, r.sampling.logit_bias) for i, r in enumerate(reqs) if r.sampling.logit_bias]
    if not rows:
        return logits
    logits = logits.clone()
    for i, bias in rows:
        ids = torch.tensor([t for t, _ in bias], dtype=torch.int64)
        logits[i].index_add_(0, ids, torch.tensor([b for _, b in bias], dtype=torch.float32))
    return logits


def _apply_penalties(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """OpenAI presence/frequency penalties over output tokens; HF/CTRL repetition penalty
    (Keskar et al. 2019) over prompt and output tokens. One bincount per penalized row."""
    rows = [
        (i, r) for i, r in enumerate(reqs)
        if r.sampling.presence_penalty or r.sampling.frequency_penalty or r.sampling.repetition_penalty != 1.0
    ]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    for i, r in rows:
        p = r.sampling
        if p.presence_penalty or p.frequency_penalty:
            counts = torch.bincount(torch.tensor(list(r.output_ids), dtype=torch.int64), minlength=vocab).float()
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(r.fill_ids(), dtype=torch.int64).unique()
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    return logits


def _filter(probs: torch.Tensor, params: list) -> torch.Tensor:
    """Zero out tokens outside top-k / top-p / min-p per row, then renormalize. probs: [B, V]."""
    needs = [p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params]
    if not any(needs):
        return probs
    vocab = probs.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab)[None, :]
    drop = rank >= top_k[:, None]
    # Nucleus: keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > top_p[:, None]
    drop |= sorted_p < (min_p[:, None] * sorted_p[:, :1])
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter_(1, sorted_idx, sorted_p)
    return out / out.sum(dim=-1, keepdim=True)
