"""Replay token streams through a DetokenizerManager as a batched scheduler would send them.

Used by the tests and the benchmark: each stream is a list of chunks (the ids one scheduler
step produced for it); step k carries chunk k of every stream that still has one, the first
row of a stream carries its RowInit, and its last row its finish reason.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ringserve.v1 import common_pb2, detokenizer_pb2


@dataclass
class StreamSpec:
    """One request as the scheduler reports it.

    Attributes:
        rid: request id.
        chunks: token ids per step (a chunk may be empty, e.g. a prefill-only step).
        finish: finish reason on the last row (FINISH_LENGTH by default).
        prompt_tail_ids, stop, skip_special_tokens, no_stop_trim: RowInit fields.
        tokenizer_id: owning tokenizer instance.
    """

    rid: str
    chunks: list[list[int]]
    finish: common_pb2.FinishReason = field(
        default_factory=lambda: common_pb2.FinishReason(type=common_pb2.FINISH_LENGTH))
    prompt_tail_ids: Sequence[int] = ()
    stop: Sequence[str] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    tokenizer_id: str = "tok-0"


def build_steps(streams: Sequence[StreamSpec]) -> Iterator[detokenizer_pb2.BatchTokenIDOutput]:
    """Yield one BatchTokenIDOutput per step for all ``streams`` running together."""
    steps = max((len(s.chunks) for s in streams), default=0)
    for k in range(steps):
        batch = detokenizer_pb2.BatchTokenIDOutput()
        rids: list[str] = []
        tids: list[str] = []
        counts: list[int] = []
        ids: list[int] = []
        fins: list[common_pb2.FinishReason] = []
        for s in streams:
            if k >= len(s.chunks):
                continue
            if k == 0:
                batch.inits.add(
                    row=len(rids), prompt_tail_ids=s.prompt_tail_ids, stop=s.stop,
                    skip_special_tokens=s.skip_special_tokens,
                    spaces_between_special_tokens=s.spaces_between_special_tokens,
                    no_stop_trim=s.no_stop_trim)
            rids.append(s.rid)
            tids.append(s.tokenizer_id)
            counts.append(len(s.chunks[k]))
            ids.extend(s.chunks[k])
            fins.append(s.finish if k == len(s.chunks) - 1 else common_pb2.FinishReason())
        batch.rids.extend(rids)
        batch.tokenizer_ids.extend(tids)
        batch.new_token_counts.extend(counts)
        batch.output_ids.extend(ids)
        batch.finish_reasons.extend(fins)
        batch.prompt_tokens.extend([0] * len(rids))
        batch.completion_tokens.extend([0] * len(rids))
        batch.cached_tokens.extend([0] * len(rids))
        yield batch


def collect(outputs: dict[str, detokenizer_pb2.BatchStrOutput], deltas: dict[str, list[str]]) -> None:
    """Append each row's text of one step's outputs to ``deltas[rid]``."""
    for out in outputs.values():
        for rid, text in zip(out.rids, out.texts, strict=True):
            deltas.setdefault(rid, []).append(text)
