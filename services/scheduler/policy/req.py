"""The scheduler's request: its token lists, sampling parameters and finish state.

As in vLLM v1's ``Request``, the token lists are private: readers get read-only views,
and the engine grows the output through one method, ``append_output``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field, make_dataclass
from typing import TYPE_CHECKING, Any

import torch

from ringserve import sampling_params as table
from services.scheduler.lora.namespace import namespaced
from services.scheduler.policy.grammar_backends import GrammarSpec, Matcher
from services.scheduler.policy.grammar_gate import GrammarGate


class FinishType(enum.IntEnum):
    """Values equal ``common_pb2.FinishReasonType`` so the wire mapping is the identity."""

    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3


@dataclass(frozen=True)
class FinishReason:
    """Why a request ended; ``matched_str`` / ``matched_token_id`` name the stop (matched_stop)."""

    type: FinishType
    matched_str: str | None = None
    matched_token_id: int | None = None
    message: str = ""
    status: str = ""  # gRPC status code name for aborts, e.g. "CANCELLED", "INVALID_ARGUMENT"


def _sampling_fields() -> list[tuple[str, object, object]]:
    """The resolved parameters of ``ringserve.sampling_params`` as dataclass fields (name, type, default).

    A parameter without a constant default is None (seed: unseeded), except
    ``max_new_tokens``: the tokenizer always sends it; a request built in code (tests,
    benchmarks) gets 128.
    """
    out: list[tuple[str, object, object]] = []
    for p in table.RESOLVED:
        default = 128 if p.name == "max_new_tokens" else p.default
        kind = p.type if default is not None else p.type | None
        out.append((p.name, kind, field(default=default)))
    return out


if TYPE_CHECKING:
    SamplingParams = Any  # made from the table at import: its fields are not visible to a type checker
else:
    SamplingParams = make_dataclass("SamplingParams", [
        *_sampling_fields(),
        ("stop", tuple[str, ...], field(default=())),
        ("stop_token_ids", frozenset[int], field(default=frozenset())),
        ("logit_bias", tuple[tuple[int, float], ...], field(default=())),  # (token id, bias), sorted by id
    ], frozen=True, namespace={"__module__": __name__, "__doc__": """Resolved sampling parameters (every default
        filled in by the tokenizer service): one field per resolved row of ``ringserve.sampling_params``
        under the proto's name (``wire`` copies them by name), then stop, stop_token_ids and logit_bias."""})


@dataclass(frozen=True)
class ReqInput:
    """A tokenized request as the engine receives it (the wire's TokenizedGenerateReqInput)."""

    rid: str
    input_ids: Sequence[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tokenizer_id: str = ""
    return_logprob: bool = False
    top_logprobs_num: int = 0
    stream: bool = True
    logprob_start_len: int | None = None  # prompt logprobs from this position; None = none
    prompt_top_logprobs_num: int = 0
    grammar: GrammarSpec | None = None  # constrained decoding (structured outputs)
    priority: int = 0  # lower runs first under the priority policy (ringserve.priority)
    embed: bool = False  # prefill only, then the pooled final hidden states (executor/pooling.py)
    embed_dimensions: int = 0  # with embed: the first this many dimensions (0 = all)
    traceparent: str = ""  # W3C trace context of the request's spans; "": not traced
    lora_name: str = ""  # the LoRA adapter it runs under (services/scheduler/lora); "": the base model
    disagg_role: int = 0  # prefill/decode part (services/scheduler/disagg/roles.Role); 0: both here
    disagg_bootstrap: str = ""  # prefill part: the decode scheduler's address


class TokenView(Sequence[int]):
    """Read-only, zero-copy view of a token list."""

    __slots__ = ("_ids",)

    def __init__(self, ids: list[int]):
        self._ids = ids

    def __getitem__(self, i):
        return self._ids[i]

    def __len__(self) -> int:
        return len(self._ids)

    def __eq__(self, other: object) -> bool:
        return list(self._ids) == list(other) if isinstance(other, Sequence) else NotImplemented

    def __repr__(self) -> str:
        return f"TokenView({self._ids!r})"


class Req:
    """One in-flight request.

    Attributes (engine-managed):
        req_slot: row in ReqToTokenPool while the request holds KV, else None.
        kv_len: tokens whose K/V are in the KV cache (positions 0..kv_len-1).
        finish_reason: set once when the request ends; None while running or waiting.
        init_sent: the detokenizer has had this rid's RowInit.
        generator: per-request torch.Generator on the sampling device when a seed is given
            (reproducible sampling; set by the engine, ``Sampler.generator_for``).
        cached_tokens: prompt tokens the prefix cache supplied at first admission (None
            until admitted); reported to clients as usage.
        last_node / tree_len: the prefix-cache node this request locks and how many of its
            leading KV rows belong to the cache (0 and None without a lock).
        prompt_logprob_pos: the next prompt position whose logprob is still to be computed
            (``prompt_len`` when none is, or none was asked); the prefix cache may supply
            only the positions before ``prompt_logprob_pos - 1``.
        prompt_logprobs / prompt_top_ids / prompt_top_vals: those computed so far, from
            position ``max(1, logprob_start_len)`` on, sent with the first sampled token.
        lora: the resident adapter it runs under (``lora.registry.Adapter``: slot, cache
            namespace), held from admission to its end; None: the base model.
        embed / embed_dimensions: an embedding request (``executor.pooling``): it samples
            nothing and ends when its prefill does, with its pooled hidden states.
        pool_from: with embed, the first prompt position whose hidden state the pooling reads
            (set by the engine: 0 for mean and cls pooling, the last for last-token pooling);
            the prefix cache supplies only the positions before it.
        pool_sum: with embed, the pooling so far (float32 [hidden] on the device): the sum
            over the chunks prefilled of their rows' share (``executor.pooling``).
        grammar: the constraint's matcher once compiled (None when unconstrained); it
            advances with every output token and survives retraction with them.
        gate: where the grammar applies (``policy.grammar_gate``); grammar_param the
            request field of the constraint, named in its errors.
        priority: lower runs first under the priority policy; arrival: the waiting queue's
            number for the request, given when it first joins and kept across retraction
            (``policy.waiting``); None before.
    """

    def __init__(self, spec: ReqInput):
        self.rid = spec.rid
        self.tokenizer_id = spec.tokenizer_id
        self.traceparent = spec.traceparent
        self.disagg_role = spec.disagg_role
        self.disagg_bootstrap = spec.disagg_bootstrap
        self.sampling = spec.sampling
        self.return_logprob = spec.return_logprob
        self.top_logprobs_num = spec.top_logprobs_num
        self._origin_input_ids = list(spec.input_ids)
        self._output_ids: list[int] = []
        self.req_slot: int | None = None
        self.kv_len = 0
        self.finish_reason: FinishReason | None = None
        self.init_sent = False
        self.generator: torch.Generator | None = None
        self.cached_tokens: int | None = None
        self.last_node: object | None = None
        self.tree_len = 0
        self.grammar: Matcher | None = None
        g = spec.grammar
        # Where the grammar applies under a reasoning parser (from the first token without one).
        self.gate = GrammarGate(g.starts_after, g.opens_with) if g is not None else GrammarGate()
        self.grammar_param = g.param if g is not None else ""
        self.logprob_start_len = spec.logprob_start_len
        self.prompt_top_logprobs_num = spec.prompt_top_logprobs_num
        start = spec.logprob_start_len
        self.prompt_logprob_pos = self.prompt_len if start is None else max(1, start)
        self.prompt_logprobs: list[float] = []
        self.prompt_top_ids: list[int] = []
        self.prompt_top_vals: list[float] = []
        self.priority = spec.priority
        self.arrival: int | None = None
        self.embed = spec.embed
        self.lora: Any = None
        self.embed_dimensions = spec.embed_dimensions
        self.pool_from: int | None = None
        self.pool_sum: torch.Tensor | None = None

    @property
    def origin_input_ids(self) -> TokenView:
        return TokenView(self._origin_input_ids)

    @property
    def output_ids(self) -> TokenView:
        return TokenView(self._output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self._origin_input_ids)

    @property
    def seq_len(self) -> int:
        """Prompt plus output tokens."""
        return len(self._origin_input_ids) + len(self._output_ids)

    def fill_ids(self) -> list[int]:
        """All tokens (prompt + output): what a (re-)prefill after retraction computes K/V for."""
        return self._origin_input_ids + self._output_ids

    def cache_ids(self) -> list[int]:
        """``fill_ids`` as the prefix cache keys them: in the adapter's namespace (``lora.namespace``)."""
        return namespaced(self.fill_ids(), self.lora.namespace if self.lora is not None else 0)

    def last_token(self) -> int:
        return self._output_ids[-1] if self._output_ids else self._origin_input_ids[-1]

    def append_output(self, token_id: int) -> None:
        self._output_ids.append(token_id)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_ids_end_output(self) -> bool:
        """A stop token id just sampled ends the output: always without a grammar; under one only
        where the grammar may end (elsewhere the mask allowed it as ordinary text)."""
        return self.grammar is None or not self.gate.grammar_decides or self.grammar.may_end
