"""Sampling: seeds reproduce, seeds differ, filters and logprobs."""

from __future__ import annotations

import math

from services.scheduler.policy.req import ReqInput, SamplingParams


def sampled(rid, ids, seed=None, n=12, **kw):
    params = SamplingParams(temperature=1.0, max_new_tokens=n, ignore_eos=True, seed=seed, **kw)
    return ReqInput(rid=rid, input_ids=ids, sampling=params)


def test_seeded_sampling_reproducible_and_seed_sensitive(make_engine, chat_ids, run_all):
    prompt = chat_ids("Invent a name for a cat.")
    engine = make_engine()
    engine.add_request(sampled("a", prompt, seed=1234))
    engine.add_request(sampled("b", prompt, seed=1234))
    engine.add_request(sampled("c", prompt, seed=99))
    engine.add_request(sampled("d", prompt, top_p=0.9, top_k=50, min_p=0.05, seed=7))
    first = run_all(engine)
    again = make_engine()
    again.add_request(sampled("a", prompt, seed=1234))
    second = run_all(again)
    assert first["a"].output_ids == first["b"].output_ids == second["a"].output_ids
    assert first["a"].output_ids != first["c"].output_ids
    assert len(first["d"].output_ids) == 12


def test_top_k_one_is_greedy_and_logprobs(make_engine, chat_ids, greedy_req, run_all):
    prompt = chat_ids("Name a colour.")
    engine = make_engine()
    engine.add_request(sampled("k1", prompt, n=10, top_k=1))
    engine.add_request(greedy_req("g", prompt, 10, ignore_eos=True))
    engine.add_request(ReqInput(rid="lp", input_ids=prompt, return_logprob=True, top_logprobs_num=3,
                                sampling=SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)))
    res = run_all(engine)
    assert res["k1"].output_ids == res["g"].output_ids == res["lp"].output_ids
    lp = res["lp"]
    assert len(lp.logprobs) == 10 and len(lp.top_ids) == 30 and len(lp.top_vals) == 30
    for t in range(10):
        ids, vals = lp.top_ids[3 * t : 3 * t + 3], lp.top_vals[3 * t : 3 * t + 3]
        assert ids[0] == lp.output_ids[t]  # greedy: the chosen token is the most likely
        assert math.isclose(vals[0], lp.logprobs[t], abs_tol=1e-6) and vals == sorted(vals, reverse=True)
        assert lp.logprobs[t] <= 0.0
    assert res["g"].logprobs == []  # no logprob columns for rows that did not ask


# --- typical_p (locally typical sampling), without a model ------------------------------------

# Entropy 1.2130 nats; |surprisal - entropy| per token: 0.520, 0.173, 0.866, 0.866. Sorted by it,
# tokens 1, 0, then 2 and 3 tied, with cumulative mass 0.25, 0.75, 0.875, 1.
PROBS = [0.5, 0.25, 0.125, 0.125]


def test_typical_keeps_the_tokens_nearest_the_entropy():
    import torch

    from services.scheduler.executor.sampling import typical

    masses = [0.2, 0.25, 0.5, 0.75, 0.76, 1.0]
    out = typical(torch.tensor([PROBS] * len(masses)), torch.tensor(masses))
    assert (out > 0).tolist() == [
        [False, True, False, False],  # token 1 alone reaches 0.2 and 0.25
        [False, True, False, False],
        [True, True, False, False],  # 0.25 < 0.5: token 0 too, 0.75 reaches 0.5 and 0.75
        [True, True, False, False],
        [True, True, True, True],  # 2 and 3 are tied: both stay
        [True, True, True, True],  # 1 is off
    ]
    assert out[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert torch.allclose(out[2], torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    assert out[5].tolist() == PROBS


def test_typical_keeps_what_hf_transformers_keeps():
    import torch
    from transformers.generation.logits_process import TypicalLogitsWarper

    from services.scheduler.executor.sampling import typical

    gen = torch.Generator().manual_seed(0)
    for mass in (0.1, 0.5, 0.9, 0.99):
        logits = torch.randn(16, 500, generator=gen) * 3
        kept = typical(torch.softmax(logits, dim=-1), torch.full((16,), mass)) > 0
        assert torch.equal(kept, torch.isfinite(TypicalLogitsWarper(mass=mass)(None, logits.clone()))), mass


def _typical_reqs(masses: list[float], return_logprob: bool = False) -> list:
    from services.scheduler.policy.req import Req

    return [Req(ReqInput(rid=f"r{i}", input_ids=[1], return_logprob=return_logprob,
                         sampling=SamplingParams(temperature=1.0, typical_p=m))) for i, m in enumerate(masses)]


def test_sampler_draws_only_kept_tokens_batched():
    import torch

    from services.scheduler.executor.device import DeviceRuntime
    from services.scheduler.executor.sampling import Sampler

    sampler = Sampler(DeviceRuntime(torch.device("cpu")), seed=0)
    masses = [0.2] * 100 + [0.5] * 100 + [1.0] * 100
    logits = torch.tensor(PROBS).log().repeat(len(masses), 1)
    result = sampler.sample(logits, _typical_reqs(masses, return_logprob=True))
    ids = result.next_ids.tolist()
    assert set(ids[:100]) == {1} and set(ids[100:200]) == {0, 1} and set(ids[200:]) == {0, 1, 2, 3}
    assert result.logprobs[:100].tolist() == [0.0] * 100  # the one kept token has all the mass


def test_typical_on_fake_cuda_tensors_reads_nothing_back():
    """Under FakeTensorMode a host sync (``.item()``, ``bool(t)``) would raise: none happens."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from services.scheduler.executor.device import CudaRuntime
    from services.scheduler.executor.sampling import Sampler

    cuda = torch.device("cuda:0")
    mode = FakeTensorMode(allow_non_fake_inputs=False)

    class FakeCuda(CudaRuntime):
        def to_device(self, host):
            return FakeTensor(mode, host.to("meta"), cuda)

        def generator(self, seed):
            return None

    with mode:
        logits = torch.empty(3, 64, device=cuda)
        result = Sampler(FakeCuda(cuda)).sample(logits, _typical_reqs([0.3, 0.9, 1.0], return_logprob=True))
    assert result.next_ids.device == cuda and tuple(result.next_ids.shape) == (3,)
    assert result.logprobs.device == cuda


def test_filters_give_a_row_the_same_bits_whatever_its_batch():
    """Deterministic inference needs the filters batch-invariant: a row filtered alone and among
    63 others is equal bit for bit (torch's ``sum`` over the vocabulary is not: it splits a row
    across threads for small batches), and a row with no filter keeps its exact probabilities
    when another row of its batch is filtered."""
    import torch

    from services.scheduler.executor.sampling import _filter, row_sum, typical

    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, 49152, generator=gen) * 3, dim=-1)
    vocab = float(probs.shape[-1])

    def filtered(rows: int) -> torch.Tensor:
        top_k = torch.tensor([40.0] + [vocab] * (rows - 1))
        top_p = torch.tensor([0.9] + [1.0] * (rows - 1))
        typical_p = torch.tensor([0.95] + [1.0] * (rows - 1))
        return typical(_filter(probs[:rows], top_k, top_p, torch.zeros(rows)), typical_p)

    alone, batched = filtered(1), filtered(64)
    assert torch.equal(alone, batched[:1]) and torch.equal(batched[1:], probs[1:])
    assert torch.equal(row_sum(probs[:1]), row_sum(probs)[:1])
    assert 0 < int((alone > 0).sum()) <= 40 and abs(float(alone.sum()) - 1.0) < 1e-5


def test_top_logprobs_order_ties_by_id_whatever_k():
    """Equal logprobs come by ascending token id and a row's first n are the same for every k >= n
    (topk alone gave topk(20)[:3] != topk(3) on tied bf16 logits); also on fake CUDA tensors."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from services.scheduler.executor.sampling import top_logprobs

    torch.manual_seed(0)
    logp = torch.randint(-6, 0, (64, 500)).float()  # six distinct values: ties everywhere
    logp[0, 7] = -float("inf")
    logp[1] = -float("inf")
    logp[1, 400] = 0.0
    # The reference: a stable descending sort keeps equal values in ascending id order.
    ref_vals, ref_ids = logp.sort(dim=-1, descending=True, stable=True)
    for k in (1, 3, 20, 133, 500):
        vals, ids = top_logprobs(logp, k)
        assert torch.equal(ids, ref_ids[:, :k]) and torch.equal(vals, ref_vals[:, :k]), k
    assert top_logprobs(logp, 3)[1].tolist()[1] == [400, 0, 1]
    with FakeTensorMode():
        vals, ids = top_logprobs(torch.empty(4, 64, device="cuda"), 5)
    assert (tuple(vals.shape), ids.dtype, ids.device.type) == ((4, 5), torch.int64, "cuda")
