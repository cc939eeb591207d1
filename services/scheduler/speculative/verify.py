"""Verification of draft tokens against the target model's distributions.

Each drafted row of a step brings ``k`` verification positions: the logits after its newest
token and after each of its first ``k - 1`` drafts (position ``j`` judges draft ``j``); the
logits after the last draft are the row's ordinary sample row, whose token is the bonus
when every draft is accepted. Per position, with ``p`` the distribution the sampler would
draw from there (``Sampler.distribution``: bias, temperature, top-k/p, min-p, typical-p):

- greedy rows accept draft ``x`` iff ``x == argmax p``; otherwise ``argmax p`` is emitted
  instead: exactly the tokens of non-speculative greedy decoding;
- sampled rows run rejection sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).
  A proposer that gives one token ``x`` is a point-mass draft distribution ``q = 1{x}``, so
  ``x`` is accepted with probability ``min(1, p(x) / q(x)) = p(x)``, and on rejection the
  token is drawn from ``norm(max(0, p - q))``: ``p`` with ``x`` removed, renormalised. Each
  emitted token is then distributed exactly as ``p``. Seeded rows draw every uniform and
  every residual sample from their own generator, so a seed reproduces its output.

Logprobs of an emitted token are under ``p`` (as the sampler reports them), top logprobs
from ``p``'s largest entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.scheduler.executor.device import DeviceRuntime
from services.scheduler.executor.sampling import Sampler, chosen_logprobs
from services.scheduler.policy.req import Req


@dataclass
class Verdicts:
    """Per verification position on the device (T positions): whether its draft is accepted,
    the token emitted there (the draft, or the replacement at the first rejection), and its
    logprob and top logprobs under ``p`` (None where no row asked)."""

    accepted: torch.Tensor  # bool [T]
    emitted: torch.Tensor  # int64 [T]
    logprobs: torch.Tensor | None  # float32 [T]
    top_ids: torch.Tensor | None  # int64 [T, K]
    top_vals: torch.Tensor | None  # float32 [T, K]

    def to_host(self, runtime: DeviceRuntime) -> list[tuple[bool, int, float | None, list[int], list[float]]]:
        """One device-to-host copy -> per position (accepted, token, logprob, top ids, top values)."""
        cols = [self.accepted.double().unsqueeze(1), self.emitted.double().unsqueeze(1)]
        if self.logprobs is not None:
            cols.append(self.logprobs.double().unsqueeze(1))
        if self.top_ids is not None and self.top_vals is not None:
            cols += [self.top_ids.double(), self.top_vals.double()]
        k = 0 if self.top_ids is None else self.top_ids.shape[1]
        rows = runtime.to_host_async(torch.cat(cols, dim=1))().tolist()  # float64: ids stay exact
        lp = self.logprobs is not None
        return [(bool(r[0]), int(r[1]), r[2] if lp else None, [int(t) for t in r[3 : 3 + k]], r[3 + k :])
                for r in rows]


def verify(sampler: Sampler, logits: torch.Tensor, reqs: list[Req], drafts: torch.Tensor) -> Verdicts:
    """Judge each draft at its verification position (module docstring).

    Args:
        logits: float32 [T, V] on the device, the raw logits of the T positions.
        reqs: [T], the request of each position (a request's positions consecutive).
        drafts: int64 [T] on the device, the draft each position judges.

    Returns:
        The verdicts (device tensors; nothing read back here).
    """
    logits, probs, is_greedy = sampler.distribution(logits, reqs)
    target = logits.argmax(dim=-1)
    want_logprob = any(r.return_logprob for r in reqs)
    if probs is None:
        accepted = target == drafts
        emitted = target  # equal to the draft where accepted
        logp = torch.log_softmax(logits, dim=-1) if want_logprob else None
    else:
        assert is_greedy is not None
        greedy = is_greedy.bool()
        p_draft = probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
        # exp(-E) with E ~ Exp(1) is uniform on (0, 1]: accepted with probability p(draft).
        uniform = torch.exp(-sampler.noise(p_draft.shape + (1,), reqs).squeeze(1))
        residual = probs.scatter(1, drafts.unsqueeze(1), 0.0)
        # The exponential race draws from the unnormalised residual as from its normalisation.
        replacement = (residual / sampler.noise(residual.shape, reqs)).argmax(dim=-1)
        accepted = torch.where(greedy, target == drafts, uniform < p_draft)
        emitted = torch.where(accepted, drafts, torch.where(greedy, target, replacement))
        logp = None
        if want_logprob:
            logp = torch.where(greedy.unsqueeze(1), torch.log_softmax(logits, dim=-1), torch.log(probs))
    if logp is None:
        return Verdicts(accepted, emitted, None, None, None)
    return Verdicts(accepted, emitted, *chosen_logprobs(logp, emitted, reqs))


def accepted_run(accepted: list[bool]) -> int:
    """How many drafts are kept: the leading accepted ones (the first rejection ends the run)."""
    n = 0
    for ok in accepted:
        if not ok:
            break
        n += 1
    return n
