"""Validate a request's sampling parameters and fill in every default.

The scalar parameters, their defaults and their bounds are the table of
``ringserve.sampling_params`` (ranges from the OpenAI API where it defines them, vLLM/SGLang's
``SamplingParams.verify`` otherwise); every message is the table's, which the gateway and the
scheduler give too. What the table cannot state is checked here: ids against the vocabulary,
stop strings, the context window, min_new_tokens against max_new_tokens. Errors are
``RequestError`` (gRPC INVALID_ARGUMENT); the message names the proto field, the "param"
trailer the OpenAI parameter (``max_new_tokens`` -> "max_tokens", ``min_new_tokens`` ->
"min_tokens").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ringserve import sampling_params as table
from ringserve.prompt_bounds import CONTEXT_LENGTH_EXCEEDED, context_overflow_message
from ringserve.v1 import common_pb2
from services.tokenizer.constraints import resolve_constraint
from services.tokenizer.errors import invalid

UINT64 = 1 << 64
# max_new_tokens may be 0 when the request only scores its prompt.
_SCORE_ONLY = replace(table.PARAMS["max_new_tokens"], lo=0)


def _check(p: table.Param, value: Any, path: str | None = None, param: str | None = None) -> None:
    """Raise the table's refusal of ``value`` (RequestError; param: the OpenAI name), if any."""
    error = table.violation(p, value, path)
    if error is not None:
        raise invalid(error, param or p.http_name)


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
    values: dict[str, Any] = {}
    for p in table.TABLE:
        if not sp.HasField(p.name):  # type: ignore[arg-type]  # the table's names are the proto's fields
            values[p.name] = p.default
            continue
        value = getattr(sp, p.name)
        _check(_SCORE_ONLY if score_only_ok and p.name == "max_new_tokens" else p, value)
        values[p.name] = value
    for s in sp.stop:
        if not s:
            raise invalid("stop strings must not be empty", "stop")
    for tid in sp.stop_token_ids:
        if not 0 <= tid < vocab_size:
            raise invalid(f"stop_token_ids: {tid} is outside the vocabulary [0, {vocab_size})", "stop_token_ids")
    for tid, bias in sp.logit_bias.items():
        if not 0 <= tid < vocab_size:
            raise invalid(f"logit_bias: token id {tid} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        _check(table.LOGIT_BIAS, bias, f"logit_bias[{tid}]")

    max_new = values["max_new_tokens"]
    if prompt_len >= context_length or (max_new is not None and prompt_len + max_new > context_length):
        raise invalid(
            context_overflow_message(context_length, prompt_len, max_new, prompt_param),
            prompt_param if prompt_len >= context_length else "max_tokens",
            CONTEXT_LENGTH_EXCEEDED,
        )
    if max_new is None:
        max_new = values["max_new_tokens"] = context_length - prompt_len
    min_new = values["min_new_tokens"]
    if min_new > max_new:
        bound = "" if sp.HasField("max_new_tokens") else ", what the context window leaves after the prompt"
        raise invalid(f"min_new_tokens ({min_new}) must not exceed max_new_tokens ({max_new}{bound})", "min_tokens")

    params = common_pb2.ResolvedSamplingParams(
        **{p.name: values[p.name] for p in table.RESOLVED if values[p.name] is not None},
        stop=list(sp.stop),
        stop_token_ids=list(sp.stop_token_ids),
        logit_bias=dict(sp.logit_bias),
    )
    if sp.HasField("constraint"):
        if min_new:
            # The grammar may allow only a stop token before min_new_tokens: nothing could be sampled.
            raise invalid(f"min_tokens cannot be combined with {sp.constraint.param or 'a constraint'}",
                          "min_tokens")
        params.constraint.CopyFrom(resolve_constraint(sp.constraint))
    return Resolved(params, values["n"])


def check_top_logprobs_num(top_logprobs_num: int) -> None:
    """top_logprobs_num in [0, 20] (OpenAI's top_logprobs range).

    Raises:
        RequestError: INVALID_ARGUMENT, param "top_logprobs".
    """
    _check(table.TOP_LOGPROBS, top_logprobs_num)


def check_prompt_logprobs(req: Any, prompt_len: int) -> None:
    """logprob_start_len (when given) inside the prompt, prompt_top_logprobs_num in [0, 20].

    Raises:
        RequestError: INVALID_ARGUMENT, param "logprob_start_len" or "prompt_logprobs".
    """
    if req.HasField("logprob_start_len") and not 0 <= req.logprob_start_len < prompt_len:
        raise invalid(f"logprob_start_len must be in [0, {prompt_len}) (the prompt has {prompt_len} tokens), "
                      f"got {req.logprob_start_len}", "logprob_start_len")
    _check(table.TOP_LOGPROBS, req.prompt_top_logprobs_num, "prompt_top_logprobs_num", "prompt_logprobs")


def seed_for_choice(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a seeded n > 1 request: seed + index, wrapping at 2**64."""
    return (seed + index) % UINT64
