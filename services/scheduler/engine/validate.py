"""Request validation in the scheduler: the last line of defence before a request holds memory.

The tokenizer service validates first and gives clients their error messages; these checks
keep a bad or hostile request from breaking the engine (an id outside the embedding
table, a request that could never fit the KV pool).
"""

from __future__ import annotations

from services.scheduler.engine.req import ReqInput


def validate(spec: ReqInput, vocab_size: int, context_length: int, max_total_tokens: int) -> str | None:
    """Return why ``spec`` cannot run, or None when it can."""
    ids = spec.input_ids
    p = spec.sampling
    if not spec.rid:
        return "rid is empty"
    if len(ids) == 0:
        return "input_ids is empty"
    if min(ids) < 0 or max(ids) >= vocab_size:
        return f"input_ids hold ids outside [0, {vocab_size})"
    if p.max_new_tokens < 0 or (p.max_new_tokens == 0 and spec.logprob_start_len is None):
        return f"max_new_tokens must be positive (0 only to score the prompt), got {p.max_new_tokens}"
    total = len(ids) + p.max_new_tokens
    if total > context_length:
        return (
            f"prompt ({len(ids)} tokens) + max_new_tokens ({p.max_new_tokens}) = {total} "
            f"exceeds the context length {context_length}"
        )
    if total > max_total_tokens:
        return f"prompt + max_new_tokens = {total} exceeds the KV pool ({max_total_tokens} tokens, --max-total-tokens / --kv-cache-gib)"
    if not 0 <= p.min_new_tokens <= p.max_new_tokens:
        return f"min_new_tokens {p.min_new_tokens} not in [0, max_new_tokens={p.max_new_tokens}]"
    if p.temperature < 0:
        return f"temperature must be >= 0, got {p.temperature}"
    if not 0 < p.top_p <= 1:
        return f"top_p must be in (0, 1], got {p.top_p}"
    if p.top_k == 0 or p.top_k < -1:
        return f"top_k must be -1 (disabled) or positive, got {p.top_k}"
    if not 0 <= p.min_p <= 1:
        return f"min_p must be in [0, 1], got {p.min_p}"
    if p.repetition_penalty <= 0:
        return f"repetition_penalty must be positive, got {p.repetition_penalty}"
    if any(not 0 <= t < vocab_size for t, _ in p.logit_bias):
        return f"logit_bias names ids outside [0, {vocab_size})"
    if spec.top_logprobs_num < 0 or spec.top_logprobs_num > vocab_size:
        return f"top_logprobs_num must be in [0, {vocab_size}], got {spec.top_logprobs_num}"
    if spec.logprob_start_len is not None and not 0 <= spec.logprob_start_len < len(ids):
        return f"logprob_start_len must be in [0, {len(ids)}) (the prompt), got {spec.logprob_start_len}"
    if not 0 <= spec.prompt_top_logprobs_num <= vocab_size:
        return f"prompt_top_logprobs_num must be in [0, {vocab_size}], got {spec.prompt_top_logprobs_num}"
    return None
