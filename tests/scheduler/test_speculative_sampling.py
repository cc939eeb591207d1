"""Speculative decoding's pieces without a model: prompt lookup, the acceptance rule, the
adaptive draft length, and the rejection sampler's output distribution (chi-square)."""

from __future__ import annotations

import numpy as np
import torch

from services.scheduler.executor.device import DeviceRuntime
from services.scheduler.executor.sampling import Sampler
from services.scheduler.policy.req import Req, ReqInput, SamplingParams
from services.scheduler.speculative.ngram import NgramProposer, lookup
from services.scheduler.speculative.speculator import Backoff
from services.scheduler.speculative.verify import accepted_run, verify

CPU = DeviceRuntime(torch.device("cpu"))
# Chi-square critical value for 5 degrees of freedom at p = 0.001.
CHI2_5_999 = 20.515


def _ids(*xs: int) -> np.ndarray:
    return np.asarray(xs, dtype=np.int64)


def test_lookup_takes_the_longest_tail_and_its_latest_occurrence():
    # Tail (2, 3) occurs at 1 and 5; the latest (5) is followed by 9, 2, 3.
    assert lookup(_ids(1, 2, 3, 4, 0, 2, 3, 9, 2, 3), 1, 3, 5) == [9, 2, 3]
    # The 3-token tail (7, 2, 3) occurs once earlier: its continuation wins over (2, 3)'s later one.
    assert lookup(_ids(7, 2, 3, 5, 6, 2, 3, 8, 7, 2, 3), 1, 3, 2) == [5, 6]
    assert lookup(_ids(1, 2, 3, 4), 1, 3, 4) == []  # 4 never occurred before
    assert lookup(_ids(5, 5), 1, 3, 4) == [5]  # the continuation ends at the sequence's end
    assert lookup(_ids(1, 2, 9, 2), 2, 3, 4) == []  # only a 1-token match, below min_match
    assert lookup(_ids(4), 1, 3, 4) == []


def test_ngram_proposer_reads_prompt_and_output():
    req = Req(ReqInput(rid="r", input_ids=[10, 11, 12, 13, 14]))
    req.append_output(11)
    req.append_output(12)
    proposer = NgramProposer(1, 3)
    assert proposer.propose([req, req], [2, 0]) == [[13, 14], []]


def test_accepted_run_stops_at_the_first_rejection():
    assert accepted_run([True, True, False, True]) == 2
    assert accepted_run([False, True]) == 0
    assert accepted_run([True, True]) == 2


def test_backoff_follows_acceptance_and_pauses_after_misses():
    b = Backoff(4)
    b.record(proposed=4, kept=1, most=4)
    assert (b.limit, b.pause) == (2, 0)
    b.record(proposed=2, kept=0, most=4)
    assert (b.limit, b.pause, b.next_pause) == (1, 1, 2)
    b.record(proposed=1, kept=0, most=4)
    assert (b.pause, b.next_pause) == (2, 4)
    b.record(proposed=1, kept=1, most=4)
    assert (b.limit, b.next_pause) == (2, 1)
    b.record(proposed=2, kept=2, most=4)
    assert b.limit == 4
    b.record(proposed=4, kept=4, most=4)
    assert b.limit == 4


def _req(rid: str, temperature: float, seed: int | None = None, **kw) -> Req:
    req = Req(ReqInput(rid=rid, input_ids=[0], return_logprob=True,
                       sampling=SamplingParams(temperature=temperature, seed=seed, **kw)))
    if seed is not None:
        req.generator = CPU.generator(seed)
    return req


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -1.0])


def _emitted(n: int, draft: int, req: Req, seed: int = 0) -> torch.Tensor:
    sampler = Sampler(CPU, seed)
    v = verify(sampler, LOGITS.repeat(n, 1), [req] * n, torch.full((n,), draft, dtype=torch.int64))
    return v.emitted, v.accepted


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_keeps_the_target_distribution():
    n = 40_000
    req = _req("s", 0.7)
    probs = torch.softmax(LOGITS / 0.7, dim=-1)
    for draft in (0, 3):  # the likeliest token and an unlikely one
        emitted, accepted = _emitted(n, draft, req)
        counts = torch.bincount(emitted, minlength=6).double()
        assert _chi2(counts, probs.double()) < CHI2_5_999, (draft, counts)
        # A draft is accepted with probability p(draft).
        assert abs(accepted.double().mean().item() - probs[draft].item()) < 0.01
    # The test can fail: emitting every draft unjudged is far from the target.
    always = torch.bincount(torch.full((n,), 3), minlength=6).double() + 1
    assert _chi2(always, probs.double()) > 100 * CHI2_5_999


def test_rejection_sampling_respects_filters():
    # top_k 2: a draft outside the top 2 is never accepted nor emitted.
    emitted, accepted = _emitted(2000, 4, _req("k", 1.0, top_k=2))
    assert not accepted.any() and set(emitted.tolist()) == {0, 1}


def test_greedy_accepts_the_argmax_only():
    req = _req("g", 0.0)
    v = verify(Sampler(CPU, 0), LOGITS.repeat(3, 1), [req] * 3, torch.tensor([0, 1, 0]))
    assert v.accepted.tolist() == [True, False, True] and v.emitted.tolist() == [0, 0, 0]
    assert v.logprobs is not None
    assert torch.equal(v.logprobs, torch.log_softmax(LOGITS, dim=-1)[[0, 0, 0]])


def test_seeded_verification_reproduces():
    def run() -> list[int]:
        req = _req("seeded", 1.0, seed=7)
        return _emitted(64, 2, req, seed=None)[0].tolist()  # the shared generator unseeded

    assert run() == run()
