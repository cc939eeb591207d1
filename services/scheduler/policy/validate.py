"""Request validation in the scheduler: the last line of defence before a request holds memory.

The tokenizer service validates first and gives clients their error messages; these checks
keep a bad or hostile request from breaking the engine (an id outside the embedding
table, a NaN temperature, a request that could never fit the KV pool). The sampling
parameters' bounds and messages are the table's (``ringserve.sampling_params``), the same
the tokenizer and the gateway refuse with.
"""

from __future__ import annotations

from ringserve import priority
from ringserve import sampling_params as table
from services.scheduler.policy.req import ReqInput

# Checked below against what the engine can do (0 new tokens only to score or embed the prompt).
_OWN_CHECKS = frozenset({"max_new_tokens", "min_new_tokens"})


def validate(spec: ReqInput, vocab_size: int, context_length: int, max_total_tokens: int,
             schedule_policy: str = "fcfs") -> str | None:
    """Return why ``spec`` cannot run, or None when it can.

    Args:
        spec: the request; vocab_size: the model vocabulary size (ids index the embedding);
        context_length / max_total_tokens: the model's window and the KV pool, in tokens;
        schedule_policy: the engine's, which decides whether a non-zero priority can be
            honoured (``ringserve.priority``).
    """
    ids = spec.input_ids
    p = spec.sampling
    if not spec.rid:
        return "rid is empty"
    if len(ids) == 0:
        return "input_ids is empty"
    if min(ids) < 0 or max(ids) >= vocab_size:
        return f"input_ids hold ids outside [0, {vocab_size})"
    if spec.embed:
        if p.max_new_tokens != 0:
            return f"an embedding request samples nothing: max_new_tokens must be 0, got {p.max_new_tokens}"
        if spec.embed_dimensions < 0:
            return f"embed_dimensions must not be negative, got {spec.embed_dimensions}"
    elif p.max_new_tokens < 0 or (p.max_new_tokens == 0 and spec.logprob_start_len is None):
        return f"max_new_tokens must be positive (0 only to score the prompt), got {p.max_new_tokens}"
    total = len(ids) + p.max_new_tokens
    if total > context_length:
        return (
            f"prompt ({len(ids)} tokens) + max_new_tokens ({p.max_new_tokens}) = {total} "
            f"exceeds the context length {context_length}"
        )
    if total > max_total_tokens:
        return (f"prompt + max_new_tokens = {total} exceeds the KV pool ({max_total_tokens} tokens, "
                "--max-total-tokens / --kv-cache-gib)")
    if not 0 <= p.min_new_tokens <= p.max_new_tokens:
        return f"min_new_tokens {p.min_new_tokens} not in [0, max_new_tokens={p.max_new_tokens}]"
    for param in table.RESOLVED:
        value = getattr(p, param.name)
        if param.name not in _OWN_CHECKS and value is not None:
            error = table.violation(param, value)
            if error is not None:
                return error
    for token, bias in p.logit_bias:
        if not 0 <= token < vocab_size:
            return f"logit_bias names ids outside [0, {vocab_size})"
        error = table.violation(table.LOGIT_BIAS, bias, f"logit_bias[{token}]")
        if error is not None:
            return error
    if spec.top_logprobs_num < 0 or spec.top_logprobs_num > vocab_size:
        return f"top_logprobs_num must be in [0, {vocab_size}], got {spec.top_logprobs_num}"
    if spec.logprob_start_len is not None and not 0 <= spec.logprob_start_len < len(ids):
        return f"logprob_start_len must be in [0, {len(ids)}) (the prompt), got {spec.logprob_start_len}"
    if not 0 <= spec.prompt_top_logprobs_num <= vocab_size:
        return f"prompt_top_logprobs_num must be in [0, {vocab_size}], got {spec.prompt_top_logprobs_num}"
    return priority.refusal(spec.priority, schedule_policy)
