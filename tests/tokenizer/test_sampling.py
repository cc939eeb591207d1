"""Sampling-parameter validation and defaults (before anything is dispatched)."""

from __future__ import annotations

import grpc
import pytest

from ringserve import sampling_params as table
from ringserve.v1 import common_pb2, tokenizer_pb2
from services.tokenizer.errors import RequestError
from services.tokenizer.sampling import context_overflow_message, resolve_sampling_params
from tests.helpers.sampling_cases import NUMERIC, inside, outside

CTX = 8192
VOCAB = 49152


def resolve(prompt_len: int = 10, **params):
    sp = common_pb2.SamplingParams()
    for key, value in params.items():
        if key == "logit_bias":
            sp.logit_bias.update(value)
        elif isinstance(value, list):
            getattr(sp, key).extend(value)
        else:
            setattr(sp, key, value)
    return resolve_sampling_params(sp, prompt_len, CTX, VOCAB, "messages")


def rejected(prompt_len: int = 10, **params) -> RequestError:
    with pytest.raises(RequestError) as info:
        resolve(prompt_len, **params)
    assert info.value.status == grpc.StatusCode.INVALID_ARGUMENT
    return info.value


def test_every_default_is_filled_in():
    r = resolve(prompt_len=100)
    p = r.params
    assert r.n == 1
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, -1, 0.0)
    assert (p.max_new_tokens, p.min_new_tokens) == (CTX - 100, 0)
    assert (p.ignore_eos, p.skip_special_tokens, p.spaces_between_special_tokens, p.no_stop_trim) == (
        False, True, True, False,
    )
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert not p.HasField("seed")


def test_given_values_are_kept():
    r = resolve(
        temperature=0.0, top_p=0.5, top_k=40, min_p=0.1, max_new_tokens=16, min_new_tokens=16, n=3, seed=7,
        stop=["\n\n"], stop_token_ids=[2], ignore_eos=True, skip_special_tokens=False, logit_bias={5: -100.0},
    )
    p = r.params
    assert r.n == 3
    assert (p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.min_new_tokens, p.seed) == (0.0, 0.5, 40, 16, 16, 7)
    assert abs(p.min_p - 0.1) < 1e-7
    assert (list(p.stop), list(p.stop_token_ids), p.ignore_eos, p.skip_special_tokens) == (["\n\n"], [2], True, False)
    assert dict(p.logit_bias) == {5: -100.0}


@pytest.mark.parametrize(
    "params, message, param",
    [
        ({"temperature": -1.0}, "temperature must be at least 0, got a negative value", "temperature"),
        ({"temperature": 3.0}, "temperature must be at most 2, got 3", "temperature"),
        ({"temperature": 2.1}, "temperature must be at most 2, got 2.1", "temperature"),  # float32 2.1 shown as 2.1
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan", "temperature"),
        ({"temperature": float("inf")}, "temperature must be a finite number, got inf", "temperature"),
        ({"top_p": 1.5}, "top_p must be at most 1, got 1.5", "top_p"),
        ({"top_p": 0.0}, "top_p must be greater than 0, got 0", "top_p"),
        ({"top_k": 0}, "top_k must be -1 (disabled) or at least 1, got 0", "top_k"),
        ({"top_k": -2}, "top_k must be -1 (disabled) or at least 1, got a negative value", "top_k"),
        ({"min_p": 1.5}, "min_p must be at most 1, got 1.5", "min_p"),
        ({"max_new_tokens": 0}, "max_new_tokens must be at least 1, got 0", "max_tokens"),
        ({"max_new_tokens": -5}, "max_new_tokens must be at least 1, got a negative value", "max_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens must be at least 0, got a negative value", "min_tokens"),
        ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens (10) must not exceed max_new_tokens (5)",
         "min_tokens"),
        ({"n": 0}, "n must be at least 1, got 0", "n"),
        ({"n": 129}, "n must be at most 128, got 129", "n"),
        ({"presence_penalty": 2.5}, "presence_penalty must be at most 2, got 2.5", "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty must be at least -2, got a negative value",
         "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than 0, got 0", "repetition_penalty"),
        ({"logit_bias": {5: 101.0}}, "logit_bias[5] must be at most 100, got 101", "logit_bias"),
        ({"logit_bias": {VOCAB: 1.0}}, f"logit_bias: token id {VOCAB} is outside the vocabulary [0, {VOCAB})",
         "logit_bias"),
        ({"stop": ["ok", ""]}, "stop strings must not be empty", "stop"),
        ({"stop_token_ids": [-1]}, f"stop_token_ids: -1 is outside the vocabulary [0, {VOCAB})", "stop_token_ids"),
    ],
)
def test_bad_parameter_is_rejected_with_its_name(params, message, param):
    err = rejected(**params)
    assert (err.message, err.param, err.code) == (message, param, "invalid_value")


@pytest.mark.parametrize("p", NUMERIC, ids=lambda p: p.name)
def test_every_table_bound_is_refused_with_the_table_message(p):
    """Every parameter of the table, just outside each bound: what a gRPC client gets is the
    message the gateway and the scheduler give (``violation``), under the OpenAI param."""
    for value in outside(p, proto=True):
        err = rejected(**{p.name: value})
        assert (err.message, err.param) == (table.violation(p, value), p.http_name), value
    r = resolve(**{p.name: inside(p)})
    value = getattr(r.params, p.name) if p.resolved else r.n
    assert value == inside(p)


def test_bool_parameters_take_both_values():
    for p in table.TABLE:
        if p.type is bool:
            assert getattr(resolve().params, p.name) is p.default
            assert getattr(resolve(**{p.name: not p.default}).params, p.name) is (not p.default)


def test_score_only_requests_may_ask_for_no_tokens():
    sp = common_pb2.SamplingParams(max_new_tokens=0)
    assert resolve_sampling_params(sp, 10, CTX, VOCAB, "prompt", score_only_ok=True).params.max_new_tokens == 0
    sp.max_new_tokens = -1
    with pytest.raises(RequestError) as info:
        resolve_sampling_params(sp, 10, CTX, VOCAB, "prompt", score_only_ok=True)
    assert info.value.message == "max_new_tokens must be at least 0, got a negative value"


def test_min_new_tokens_over_the_window_default():
    err = rejected(prompt_len=8000, min_new_tokens=300)
    assert err.message == (
        "min_new_tokens (300) must not exceed max_new_tokens (192, what the context window leaves after the prompt)"
    )


def test_context_overflow_states_the_numbers():
    err = rejected(prompt_len=8800, max_new_tokens=200)
    assert err.message == (
        "This model's maximum context length is 8192 tokens. However, you requested 9000 tokens "
        "(8800 in the messages, 200 in the completion). Please reduce the length of the messages or completion."
    )
    assert (err.code, err.param) == ("context_length_exceeded", "messages")

    err = rejected(prompt_len=8000, max_new_tokens=500)
    assert "you requested 8500 tokens (8000 in the messages, 500 in the completion)" in err.message
    assert (err.code, err.param) == ("context_length_exceeded", "max_tokens")

    err = rejected(prompt_len=9000)
    assert err.message == (
        "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens, "
        "which leaves no room for the completion (at least 1 token). Please reduce the length of the messages."
    )
    assert (err.code, err.param) == ("context_length_exceeded", "messages")

    assert rejected(prompt_len=CTX).code == "context_length_exceeded"
    assert resolve(prompt_len=CTX - 1).params.max_new_tokens == 1
    assert resolve(prompt_len=CTX - 16, max_new_tokens=16).params.max_new_tokens == 16


def test_overflow_of_a_real_prompt_counts_its_tokens(manager):
    text = "The quick brown fox jumps over the lazy dog. " * 1100  # about 1.2x the window
    n_tokens = len(manager.tokenizer.encode(text))
    assert n_tokens > CTX
    for sp, max_new in ((common_pb2.SamplingParams(), None), (common_pb2.SamplingParams(max_new_tokens=100), 100)):
        with pytest.raises(RequestError) as info:
            manager.prepare(tokenizer_pb2.GenerateReqInput(text=text, sampling_params=sp))
        assert info.value.message == context_overflow_message(CTX, n_tokens, max_new, "prompt")
        assert str(n_tokens) in info.value.message and "8192" in info.value.message
        assert (info.value.code, info.value.param) == ("context_length_exceeded", "prompt")
    assert manager.load().req_states == 0


def test_top_logprobs_range(manager):
    with pytest.raises(RequestError) as info:
        manager.prepare(tokenizer_pb2.GenerateReqInput(text="hi", return_logprob=True, top_logprobs_num=21))
    assert info.value.message == "top_logprobs_num must be at most 20, got 21"


def test_the_docs_table_is_generated_from_the_table():
    lines = table.markdown().splitlines()
    assert len(lines) == 2 + len(table.TABLE)
    assert lines[2] == ("| `temperature` | `temperature` | float | 1 | [0, 2] | "
                        "Divides the logits before sampling; 0 is greedy. |")
    assert "| `top_k` | `top_k` | int | -1 | -1 or [1, 2147483647] |" in table.markdown()
    assert "| `max_new_tokens` | `max_tokens` | int | — | [1, 2147483647] |" in table.markdown()
    assert "| `seed` | `seed` | int | — | [0, 18446744073709551616) |" in table.markdown()
