"""The scheduler's own request validation (no model): every sampling parameter of the table is
refused outside its bounds with the message the tokenizer and the gateway give."""

from __future__ import annotations

import dataclasses

import pytest

from ringserve import sampling_params as table
from services.scheduler.policy.req import ReqInput, SamplingParams
from services.scheduler.policy.validate import validate
from tests.helpers.sampling_cases import NUMERIC, inside, outside

VOCAB, CONTEXT, POOL = 100, 64, 128


def check(logprob_start_len: int | None = None, **sampling) -> str | None:
    spec = ReqInput(rid="r", input_ids=[1, 2, 3], logprob_start_len=logprob_start_len,
                    sampling=SamplingParams(**{"max_new_tokens": 8, **sampling}))
    return validate(spec, VOCAB, CONTEXT, POOL)


@pytest.mark.parametrize("p", [p for p in NUMERIC if p.resolved and p.name not in ("max_new_tokens", "min_new_tokens")],
                         ids=lambda p: p.name)
def test_table_bounds(p):
    for value in outside(p):
        assert check(**{p.name: value}) == table.violation(p, value), value
    assert check(**{p.name: inside(p)}) is None


def test_messages():
    assert check(temperature=3.0) == "temperature must be at most 2, got 3"
    assert check(temperature=float("nan")) == "temperature must be a finite number, got nan"
    assert check(top_k=0) == "top_k must be -1 (disabled) or at least 1, got 0"
    assert check(repetition_penalty=float("-inf")) == "repetition_penalty must be a finite number, got -inf"
    assert check(logit_bias=((5, float("nan")),)) == "logit_bias[5] must be a finite number, got nan"
    assert check(logit_bias=((5, 101.0),)) == "logit_bias[5] must be at most 100, got 101"
    assert check(logit_bias=((VOCAB, 1.0),)) == f"logit_bias names ids outside [0, {VOCAB})"
    assert check(logit_bias=((5, -100.0),), seed=None, top_k=-1) is None


def test_lengths():
    assert check(max_new_tokens=0) == "max_new_tokens must be positive (0 only to score the prompt), got 0"
    assert check(max_new_tokens=0, logprob_start_len=0) is None
    assert check(max_new_tokens=CONTEXT) == f"prompt (3 tokens) + max_new_tokens ({CONTEXT}) = {CONTEXT + 3} " \
                                            f"exceeds the context length {CONTEXT}"
    assert check(min_new_tokens=9) == "min_new_tokens 9 not in [0, max_new_tokens=8]"


def test_every_resolved_parameter_is_a_field():
    """The scheduler's SamplingParams is the table's resolved rows plus the non-scalars, in that order."""
    names = [f.name for f in dataclasses.fields(SamplingParams)]
    assert names == [p.name for p in table.RESOLVED] + ["stop", "stop_token_ids", "logit_bias"]
    defaults = SamplingParams()
    assert all(getattr(defaults, p.name) == p.default for p in table.RESOLVED if p.name != "max_new_tokens")


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "priority"])
def test_a_priority_is_refused_unless_the_policy_honours_it(policy):
    spec = ReqInput(rid="r", input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=8), priority=-1)
    want = None if policy == "priority" else (
        f"priority must be 0 under --schedule-policy {policy}: the scheduler orders requests by priority only "
        "when started with --schedule-policy priority")
    assert validate(spec, VOCAB, CONTEXT, POOL, policy) == want
    assert validate(dataclasses.replace(spec, priority=0), VOCAB, CONTEXT, POOL, policy) is None
    assert validate(dataclasses.replace(spec, priority=2**31), VOCAB, CONTEXT, POOL, policy) == (
        "priority must be at most 2147483647, got 2147483648")
