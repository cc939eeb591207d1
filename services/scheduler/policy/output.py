"""One step's output rows, columnar like the wire's BatchTokenIDOutput (gRPC-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.policy.req import FinishReason, Req

# Prompt ids sent with a rid's first row: enough decode context for the detokenizer to
# render the first output token's leading space / partial character correctly.
PROMPT_TAIL = 5


@dataclass(frozen=True)
class RowInit:
    """Once-per-rid facts for the detokenizer (the wire's RowInit)."""

    row: int
    prompt_tail_ids: list[int]
    stop: tuple[str, ...]
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    no_stop_trim: bool
    top_logprobs_num: int
    traceparent: str = ""  # the request's trace context, for the detokenizer's span


@dataclass(frozen=True)
class PromptLogprobsRow:
    """A rid's prompt logprobs (the wire's PromptLogprobs), sent once with its first token."""

    row: int
    start: int
    logprobs: list[float]
    top_n: int
    top_ids: list[int]
    top_vals: list[float]


@dataclass(frozen=True)
class EmbeddingRow:
    """A rid's embedding (the wire's PooledEmbedding), sent once with its final row."""

    row: int
    values: list[float]


@dataclass
class StepOutput:
    """Every row that produced tokens or finished in one step: the scheduler's writer of the
    columnar layout ``ringserve.columns.TOKEN_IDS`` (which states how rows own segments).

    Rows are appended whole (``add_row``, then its logprobs), so every row column stays one
    entry per row; ``logprob_counts`` is 0 for rows without logprobs, and a row's top
    logprobs are its ``top_logprobs_num`` ids/values per logprob. ``finish_reasons[i]`` is
    None while the request runs.
    """

    rids: list[str] = field(default_factory=list)
    tokenizer_ids: list[str] = field(default_factory=list)
    new_token_counts: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    inits: list[RowInit] = field(default_factory=list)
    finish_reasons: list[FinishReason | None] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int] = field(default_factory=list)
    logprob_counts: list[int] = field(default_factory=list)
    output_token_logprobs: list[float] = field(default_factory=list)
    top_logprob_ids: list[int] = field(default_factory=list)
    top_logprob_vals: list[float] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobsRow] = field(default_factory=list)
    embeddings: list[EmbeddingRow] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rids)

    def add_row(self, req: Req, new_ids: list[int]) -> None:
        """Append req's row; the first row of a rid carries its RowInit."""
        row = len(self.rids)
        if not req.init_sent:
            req.init_sent = True
            p = req.sampling
            self.inits.append(
                RowInit(row, list(req.origin_input_ids[-PROMPT_TAIL:]), p.stop, p.skip_special_tokens,
                        p.spaces_between_special_tokens, p.no_stop_trim, req.top_logprobs_num, req.traceparent)
            )
        self.rids.append(req.rid)
        self.tokenizer_ids.append(req.tokenizer_id)
        self.new_token_counts.append(len(new_ids))
        self.output_ids.extend(new_ids)
        self.finish_reasons.append(req.finish_reason)
        self.prompt_tokens.append(req.prompt_len)
        self.completion_tokens.append(len(req.output_ids))
        self.cached_tokens.append(req.cached_tokens or 0)
        self.logprob_counts.append(0)

    def add_logprobs(self, logprob: float, top_ids: list[int], top_vals: list[float]) -> None:
        """Attach one token's logprob (and its top-k) to the row added last."""
        self.logprob_counts[-1] += 1
        self.output_token_logprobs.append(logprob)
        self.top_logprob_ids.extend(top_ids)
        self.top_logprob_vals.extend(top_vals)

    def add_prompt_logprobs(self, req: Req) -> None:
        """Attach req's prompt logprobs (all computed: its prefill is done) to the row added last."""
        start = max(1, req.logprob_start_len or 0)
        self.prompt_logprobs.append(PromptLogprobsRow(
            len(self.rids) - 1, start, req.prompt_logprobs, req.prompt_top_logprobs_num,
            req.prompt_top_ids, req.prompt_top_vals))

    def add_embedding(self, values: list[float]) -> None:
        """Attach an embedding request's vector (its prefill done) to the row added last."""
        self.embeddings.append(EmbeddingRow(len(self.rids) - 1, values))
