"""Batched token sampling on the logits' device: greedy, temperature, top-k, top-p, min-p,
typical-p, penalties, logit bias, min tokens, seeds.

The filter order follows SGLang's sampler: temperature scaling, softmax, then top-k,
top-p (nucleus, Holtzman et al. 2019) and min-p (Nguyen et al. 2024) on the sorted
probabilities, renormalized; then locally typical sampling (Meister et al. 2022), after them
as in HF transformers' warpers. The draw is the exponential race ``argmax(p / E)``,
``E ~ Exp(1)`` (equivalent to the Gumbel-max trick), which lets each seeded request take
its noise from its own generator on the device while the arithmetic stays batched.
Everything runs in float32.

Every per-row parameter and index is built on the host from the requests and copied to
the device (``DeviceRuntime.to_device``); nothing here reads the device. The step's one
device-to-host copy is ``SampleResult.start_copy``: the chosen ids, with their logprobs and
top logprobs packed beside them when a row asked for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.scheduler.executor.device import DeviceRuntime
from services.scheduler.policy.req import Req


@dataclass
class SampleResult:
    """Chosen token ids and, for rows that asked, their logprobs (device tensors).

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

    def start_copy(self, runtime: DeviceRuntime) -> Callable[[], HostSample]:
        """Start the one device-to-host copy of everything; the returned function waits
        for it -> Python lists."""
        if self.logprobs is None:
            ids = runtime.to_host_async(self.next_ids)
            return lambda: HostSample(ids().tolist())
        cols = [self.next_ids.double().unsqueeze(1), self.logprobs.double().unsqueeze(1)]
        if self.top_ids is not None:
            cols += [self.top_ids.double(), self.top_vals.double()]
        packed = runtime.to_host_async(torch.cat(cols, dim=1))  # [B, 2 + 2K] float64: ids stay exact
        k = 0 if self.top_ids is None else self.top_ids.shape[1]

        def wait() -> HostSample:
            rows = packed().tolist()
            return HostSample([int(r[0]) for r in rows], [r[1] for r in rows],
                              [[int(t) for t in r[2 : 2 + k]] for r in rows] if k else None,
                              [r[2 + k :] for r in rows] if k else None)

        return wait


@dataclass
class HostSample:
    """``SampleResult`` on the host: per row the id, and where asked its logprob and top logprobs."""

    next_ids: list[int]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_vals: list[list[float]] | None = None


class Sampler:
    """Samples one token per row of a logits batch on ``runtime.device``. Unseeded rows share ``generator``."""

    def __init__(self, runtime: DeviceRuntime, seed: int | None = None, eos_ids: frozenset[int] = frozenset()):
        self.runtime = runtime
        self.eos_ids = eos_ids
        self.generator = runtime.generator(seed)

    def generator_for(self, seed: int) -> torch.Generator:
        """A request's own generator on the device (``SamplingParams.seed``)."""
        return self.runtime.generator(seed)

    def _dev(self, values, dtype=torch.int64) -> torch.Tensor:
        return self.runtime.to_device(torch.tensor(values, dtype=dtype))

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> SampleResult:
        """logits: float32 [B, V] on the device, row i belongs to reqs[i] -> SampleResult."""
        logits, probs, is_greedy = self.distribution(logits, reqs)
        greedy = [r.sampling.temperature == 0.0 for r in reqs]
        want_logprob = any(r.return_logprob for r in reqs)
        if probs is None:
            next_ids = self.runtime.argmax(logits)
            logp = torch.log_softmax(logits, dim=-1) if want_logprob else None
        else:
            assert is_greedy is not None
            noise = self.noise(probs.shape, reqs)
            next_ids = self.runtime.argmax(probs / noise)
            mask = is_greedy.bool()
            if any(greedy):
                next_ids = torch.where(mask, self.runtime.argmax(logits), next_ids)
            logp = None
            if want_logprob:
                logp = torch.log(probs)
                if any(greedy):
                    logp = torch.where(mask.unsqueeze(1), torch.log_softmax(logits, dim=-1), logp)
        result = SampleResult(next_ids)
        if logp is not None:
            result.logprobs, result.top_ids, result.top_vals = chosen_logprobs(logp, next_ids, reqs)
        return result

    def distribution(self, logits: torch.Tensor, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                           torch.Tensor | None]:
        """What each row samples from (also what speculative verification accepts drafts by).

        Args:
            logits: float32 [B, V] on the device, row i belongs to reqs[i].

        Returns:
            (the logits after bias, penalties and min-token bans [B, V]; the probabilities
            after temperature, top-k, top-p, min-p and typical-p [B, V], None when every
            row is greedy; float32 [B] 1.0 on greedy rows, None when every row is).
        """
        logits = self._apply_penalties(self._apply_logit_bias(logits, reqs), reqs)
        logits = self._ban_stops_before_min_tokens(logits, reqs)
        params = [r.sampling for r in reqs]
        greedy = [p.temperature == 0.0 for p in params]
        if all(greedy):
            return logits, None, None
        # One copy for every row's parameters: temperature, top-k, top-p, min-p, greedy, typical-p.
        rows = self._dev([[p.temperature or 1.0 for p in params],
                          [float(p.top_k if p.top_k > 0 else logits.shape[-1]) for p in params],
                          [p.top_p for p in params], [p.min_p for p in params],
                          [float(g) for g in greedy], [p.typical_p for p in params]], torch.float32)
        temps, top_k, top_p, min_p, is_greedy, typical_p = rows.unbind(0)
        probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            probs = _filter(probs, top_k, top_p, min_p)
        if any(p.typical_p < 1.0 for p in params):
            probs = typical(probs, typical_p)
        return logits, probs, is_greedy

    def _ban_stops_before_min_tokens(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """Below min_new_tokens, EOS (unless ignore_eos) and stop token ids cannot be sampled (as vLLM's min_tokens)."""
        rows, cols = [], []
        for i, r in enumerate(reqs):
            if len(r.output_ids) < r.sampling.min_new_tokens:
                banned = set(r.sampling.stop_token_ids) | (set() if r.sampling.ignore_eos else set(self.eos_ids))
                rows += [i] * len(banned)
                cols += sorted(banned)
        if not rows:
            return logits
        index = self._dev([rows, cols])
        return logits.index_put((index.select(0, 0), index.select(0, 1)),
                                torch.full((len(rows),), float("-inf"), device=logits.device))

    def noise(self, shape: torch.Size, reqs: list[Req]) -> torch.Tensor:
        """float32 ``shape`` of Exp(1) draws on the device, row i from reqs[i]'s own generator
        when it has a seed, else from the shared one."""
        noise = torch.empty(shape, dtype=torch.float32, device=self.runtime.device)
        noise.exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                noise.select(0, i).exponential_(generator=r.generator)
        return noise

    def _apply_logit_bias(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        rows, cols, vals = [], [], []
        for i, r in enumerate(reqs):
            for token, bias in r.sampling.logit_bias:
                rows.append(i)
                cols.append(token)
                vals.append(bias)
        if not rows:
            return logits
        index = self._dev([rows, cols])
        return logits.index_put((index.select(0, 0), index.select(0, 1)), self._dev(vals, torch.float32),
                                accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """OpenAI presence/frequency penalties over output tokens; HF/CTRL repetition penalty
        (Keskar et al. 2019) over prompt and output tokens. Token counts and seen-sets are
        scattered on the device from (row, token) pairs, for the penalized rows only."""
        counted = [(i, r) for i, r in enumerate(reqs) if r.sampling.presence_penalty or r.sampling.frequency_penalty]
        repeated = [(i, r) for i, r in enumerate(reqs) if r.sampling.repetition_penalty != 1.0]
        if not counted and not repeated:
            return logits
        vocab = logits.shape[-1]
        dev = logits.device
        logits = logits.clone()
        if counted:
            pairs = [(j, t) for j, (_, r) in enumerate(counted) for t in r.output_ids]
            counts = torch.zeros(len(counted), vocab, dtype=torch.float32, device=dev)
            if pairs:
                index = self._dev(list(zip(*pairs, strict=True)))
                counts.index_put_((index.select(0, 0), index.select(0, 1)),
                                  torch.ones(len(pairs), dtype=torch.float32, device=dev), accumulate=True)
            coef = self._dev([[r.sampling.frequency_penalty for _, r in counted],
                              [r.sampling.presence_penalty for _, r in counted]], torch.float32)
            delta = coef.select(0, 0).unsqueeze(1) * counts + coef.select(0, 1).unsqueeze(1) * (counts > 0).float()
            logits.index_add_(0, self._dev([i for i, _ in counted]), -delta)
        if repeated:
            pairs = [(j, t) for j, (_, r) in enumerate(repeated) for t in r.fill_ids()]
            index = self._dev(list(zip(*pairs, strict=True)))
            seen = torch.zeros(len(repeated), vocab, dtype=torch.bool, device=dev)
            seen.index_put_((index.select(0, 0), index.select(0, 1)),
                            torch.ones(len(pairs), dtype=torch.bool, device=dev))
            rows = self._dev([i for i, _ in repeated])
            penalty = self._dev([r.sampling.repetition_penalty for _, r in repeated], torch.float32).unsqueeze(1)
            vals = logits.index_select(0, rows)
            scaled = torch.where(vals > 0, vals / penalty, vals * penalty)
            logits.index_copy_(0, rows, torch.where(seen, scaled, vals))
        return logits


def chosen_logprobs(logp: torch.Tensor, ids: torch.Tensor, reqs: list[Req]
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The logprob of each row's chosen token and the batch's top logprobs.

    Args:
        logp: float32 [B, V] log-probabilities; ids: int64 [B], row i's chosen token; reqs:
            the rows' requests (K is their largest ``top_logprobs_num``).

    Returns:
        (float32 [B], int64 [B, K] top ids, float32 [B, K] top values), the last two None when K is 0.
    """
    chosen = logp.gather(1, ids.unsqueeze(1)).squeeze(1)
    k = max(r.top_logprobs_num for r in reqs)
    if k == 0:
        return chosen, None, None
    top_vals, top_ids = top_logprobs(logp, k)
    return chosen, top_ids, top_vals


def top_logprobs(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k highest logprobs, highest first and equal ones by ascending token id.

    ``topk`` alone orders (and, at the k-th value, picks) equal logprobs in an order that depends
    on k, and bf16 logits tie often: a row's first n entries would then depend on the largest
    ``top_logprobs`` of the batch it shares. Here they are the same for every k >= n. No host
    sync: the k-th value t bounds the set (every value above t, then the lowest ids equal to t),
    whose k members are sorted by id and then, stably, by value.

    Args:
        logp: float32 [R, V]; k: 1 <= k <= V.

    Returns:
        (float32 [R, k] values, int64 [R, k] token ids).
    """
    t = logp.topk(k, dim=-1).values.narrow(1, k - 1, 1)  # [R, 1]: the k-th value (ties or not)
    above = logp > t
    equal = logp == t
    room = k - above.sum(dim=-1, keepdim=True)  # how many ids equal to t belong to the set
    chosen = above | (equal & (equal.cumsum(dim=-1) <= room))  # exactly k per row
    ids = chosen.to(logp.dtype).topk(k, dim=-1).indices.sort(dim=-1).values  # the set, by id
    vals = logp.gather(1, ids)
    vals, order = vals.sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, order)


def _filter(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero out tokens outside top-k / top-p / min-p per row, then renormalize; a row with
    none of the three comes back with its bits unchanged.

    Args:
        probs: float32 [B, V]; top_k (as float, V = off), top_p, min_p: float32 [B].
    """
    vocab = probs.shape[-1]
    sorted_p, sorted_idx = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device).unsqueeze(0)
    drop = rank >= top_k.unsqueeze(1)
    # Nucleus: keep the smallest prefix whose mass reaches top_p (the first token always stays).
    drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > top_p.unsqueeze(1)
    drop |= sorted_p < (min_p.unsqueeze(1) * sorted_p.narrow(1, 0, 1))
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    active = ((top_k < vocab) | (top_p < 1.0) | (min_p > 0.0)).unsqueeze(1)
    kept = sorted_p / row_sum(sorted_p)
    # Rows without a filter keep their bits.
    return torch.where(active, torch.zeros_like(probs).scatter_(1, sorted_idx, kept), probs)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """x: float32 [B, V] -> [B, 1], each row summed in index order by one thread.

    torch's ``sum`` over a long last dimension splits a row across threads when the batch
    has few rows, so a row's bits would depend on the batch and break deterministic
    inference; a running sum is computed per row whatever the batch.
    """
    return x.cumsum(dim=-1).narrow(1, x.shape[-1] - 1, 1)


def typical(probs: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022, "Locally Typical Sampling"), per row.

    Keeps the tokens whose surprisal ``-log p`` is closest to the distribution's entropy,
    closest first, until their mass reaches the row's ``mass``, and every token as close as the
    last one kept (ties stay together, as HF transformers' ``TypicalLogitsWarper``), then
    renormalizes. The most typical token always stays. Batched: one sort of the vocabulary,
    no per-row loop, nothing read back to the host.

    Args:
        probs: float32 [B, V], rows summing to 1 (zeros allowed: they stay zero).
        mass: float32 [B], each in (0, 1]; a row with 1 is left as it is.

    Returns:
        float32 [B, V], renormalized.
    """
    entropy = -row_sum(torch.special.xlogy(probs, probs))  # [B, 1]; 0 log 0 = 0
    shift = (-torch.log(probs) - entropy).abs()  # [B, V]; inf where p = 0
    sorted_shift, order = shift.sort(dim=-1)
    reached = (probs.gather(1, order).cumsum(dim=-1) < mass.unsqueeze(1)).sum(dim=-1, keepdim=True)
    cutoff = sorted_shift.gather(1, reached.clamp(max=probs.shape[-1] - 1))  # the last kept token's shift
    # A row at 1 keeps everything: its cumulative sum may pass 1 early in float32.
    active = (mass < 1.0).unsqueeze(1)
    out = probs.masked_fill((shift > cutoff) & active, 0.0)
    return torch.where(active, out / row_sum(out), probs)  # other rows keep their bits
