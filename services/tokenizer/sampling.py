"""Validate a request's sampling parameters and fill in every default.

Ranges follow the OpenAI API where it defines them (temperature, top_p, n,
penalties, logit_bias, top_logprobs) and vLLM/SGLang's ``SamplingParams.verify``
otherwise (top_k, min_p, repetition_penalty, min_new_tokens). NaN and infinite
floats are rejected. Errors are ``RequestError`` (gRPC INVALID_ARGUMENT); the
message names the proto field, the "param" trailer names the OpenAI parameter
(``max_new_tokens`` -> "max_tokens", ``min_new_tokens`` -> "min_tokens").
"""

from __future__ import annotations

from typing import Any

import math
from dataclasses import dataclass

from ringserve.prompt_bounds import context_overflow_message
from ringserve.v1 import common_pb2
from services.tokenizer.constraints import resolve_constraint
from services.tokenizer.errors import CONTEXT_LENGTH_EXCEEDED, invalid

MAX_N = 128
MAX_TOP_LOGPROBS = 20
UINT64 = 1 << 64

OPENAI_PARAM = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "top_logprobs_num": "top_logprobs"}


def _param(name: str) -> str:
    return OPENAI_PARAM.get(name, name)


def _float(sp: common_pb2.SamplingParams, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    if not sp.HasField(name):
        return default
    v = getattr(sp, name)
    ok = math.isfinite(v) and (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        raise invalid(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v:g}", _param(name))
    return v


@dataclass(frozen=True)
class Resolved:
    """Validated sampling parameters of one request (before ``n`` expansion)."""

    params: common_pb2.ResolvedSamplingParams
    n: int


def resolve_sampling_params(
    sp: common_pb2.SamplingParams,
    prompt_len: int,
    context_length: int,
    vocab_size: int,
    prompt_param: str = "prompt",
    score_only_ok: bool = False,
) -> Resolved:
    """Check ``sp`` against the model and the prompt; return it with every default filled in.

    Args:
        sp: the parameters as the client sent them (optional fields may be unset).
        prompt_len: prompt length in tokens (> 0).
        context_length: the model's context window in tokens.
        vocab_size: ids must lie in [0, vocab_size) (stop_token_ids, logit_bias keys).
        prompt_param: "messages" (chat) or "prompt" (text / input_ids), for errors.
        score_only_ok: max_new_tokens may be 0 (the request asks for prompt logprobs:
            it scores the prompt and generates nothing).

    Returns:
        ``Resolved``: ``params.max_new_tokens`` defaults to ``context_length - prompt_len``.

    Raises:
        RequestError: INVALID_ARGUMENT; code "context_length_exceeded" when the prompt
            (plus max_new_tokens) does not fit, else "invalid_value".
    """
    temperature = _float(sp, "temperature", 1.0, 0.0, 2.0)
    top_p = _float(sp, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    min_p = _float(sp, "min_p", 0.0, 0.0, 1.0)
    presence_penalty = _float(sp, "presence_penalty", 0.0, -2.0, 2.0)
    frequency_penalty = _float(sp, "frequency_penalty", 0.0, -2.0, 2.0)
    repetition_penalty = _float(sp, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True)

    top_k = sp.top_k if sp.HasField("top_k") else -1
    if top_k != -1 and top_k < 1:
        raise invalid(f"top_k must be -1 (disabled) or at least 1, got {top_k}", "top_k")
    n = sp.n if sp.HasField("n") else 1
    if not 1 <= n <= MAX_N:
        raise invalid(f"n must be in [1, {MAX_N}], got {n}", "n")
    lowest = 0 if score_only_ok else 1
    if sp.HasField("max_new_tokens") and sp.max_new_tokens < lowest:
        raise invalid(f"max_new_tokens must be at least {lowest}, got {sp.max_new_tokens}", "max_tokens")
    if sp.HasField("min_new_tokens") and sp.min_new_tokens < 0:
        raise invalid(f"min_new_tokens must be at least 0, got {sp.min_new_tokens}", "min_tokens")
    for s in sp.stop:
        if not s:
            raise invalid("stop strings must not be empty", "stop")
    for tid in sp.stop_token_ids:
        if not 0 <= tid < vocab_size:
            raise invalid(f"stop_token_ids: {tid} is outside the vocabulary [0, {vocab_size})", "stop_token_ids")
    for tid, bias in sp.logit_bias.items():
        if not 0 <= tid < vocab_size:
            raise invalid(f"logit_bias: token id {tid} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
            raise invalid(f"logit_bias: the bias of token {tid} must be in [-100, 100], got {bias:g}", "logit_bias")

    max_new = sp.max_new_tokens if sp.HasField("max_new_tokens") else None
    if prompt_len >= context_length or (max_new is not None and prompt_len + max_new > context_length):
        raise invalid(
            context_overflow_message(context_length, prompt_len, max_new, prompt_param),
            prompt_param if prompt_len >= context_length else "max_tokens",
            CONTEXT_LENGTH_EXCEEDED,
        )
    if max_new is None:
        max_new = context_length - prompt_len
    min_new = sp.min_new_tokens if sp.HasField("min_new_tokens") else 0
    if min_new > max_new:
        bound = "" if sp.HasField("max_new_tokens") else ", what the context window leaves after the prompt"
        raise invalid(f"min_new_tokens ({min_new}) must not exceed max_new_tokens ({max_new}{bound})", "min_tokens")

    params = common_pb2.ResolvedSamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        stop=list(sp.stop),
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos if sp.HasField("ignore_eos") else False,
        skip_special_tokens=sp.skip_special_tokens if sp.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=(
            sp.spaces_between_special_tokens if sp.HasField("spaces_between_special_tokens") else True
        ),
        no_stop_trim=sp.no_stop_trim if sp.HasField("no_stop_trim") else False,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        logit_bias=dict(sp.logit_bias),
    )
    if sp.HasField("seed"):
        params.seed = sp.seed
    if sp.HasField("constraint"):
        if min_new:
            # The grammar may allow only a stop token before min_new_tokens: nothing could be sampled.
            raise invalid(f"min_tokens cannot be combined with {sp.constraint.param or 'a constraint'}",
                          "min_tokens")
        params.constraint.CopyFrom(resolve_constraint(sp.constraint))
    return Resolved(params, n)


def check_top_logprobs_num(top_logprobs_num: int) -> None:
    """top_logprobs_num in [0, 20] (OpenAI's top_logprobs range).

    Raises:
        RequestError: INVALID_ARGUMENT, param "top_logprobs".
    """
    if not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise invalid(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs_num}", "top_logprobs")


def check_prompt_logprobs(req: Any, prompt_len: int) -> None:
    """logprob_start_len (when given) inside the prompt, prompt_top_logprobs_num in [0, 20].

    Raises:
        RequestError: INVALID_ARGUMENT, param "logprob_start_len" or "prompt_logprobs".
    """
    if req.HasField("logprob_start_len") and not 0 <= req.logprob_start_len < prompt_len:
        raise invalid(f"logprob_start_len must be in [0, {prompt_len}) (the prompt has {prompt_len} tokens), "
                      f"got {req.logprob_start_len}", "logprob_start_len")
    if not 0 <= req.prompt_top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise invalid(f"prompt_top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], "
                      f"got {req.prompt_top_logprobs_num}", "prompt_logprobs")


def seed_for_choice(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a seeded n > 1 request: seed + index, wrapping at 2**64."""
    return (seed + index) % UINT64
