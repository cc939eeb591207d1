"""BatchStrOutput assembly: one message per owning tokenizer instance per step."""

from __future__ import annotations

from operator import itemgetter

from ringserve import columns
from ringserve.v1 import common_pb2, detokenizer_pb2

# An empty BatchStrOutput.finish_reasons element on the wire (field 5, length 0): parsing
# n of them is far cheaper than copying n FinishReason messages one by one.
_FIN_TAG = b"\x2a"
_EMPTY_FIN = b"\x2a\x00"


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def group_outputs(batch: detokenizer_pb2.BatchTokenIDOutput, rids: list[str], texts: list[str],
                  ftypes: list[int], errors: dict[int, common_pb2.FinishReason | None],
                  top_ns: list[int] | None) -> dict[str, detokenizer_pb2.BatchStrOutput]:
    """One BatchStrOutput per tokenizer instance, passing ids, counts, logprobs and embeddings through.

    Args:
        batch: the step's input; rids, texts, ftypes: per row.
        errors: row -> FINISH_ABORT that replaces the scheduler's finish reason, or None
            for a row that is dropped (already answered).
        top_ns: top logprobs per position per row, when the batch carries top logprobs.
    """
    tids = batch.tokenizer_ids
    n = len(rids)
    if not errors and len(set(tids)) == 1:
        # One owner, no error row: every column passes through whole (the common case).
        out = detokenizer_pb2.BatchStrOutput(
            rids=rids, texts=texts, new_token_counts=batch.new_token_counts,
            output_ids=batch.output_ids, prompt_tokens=batch.prompt_tokens,
            completion_tokens=batch.completion_tokens, cached_tokens=batch.cached_tokens,
            logprob_counts=batch.logprob_counts, output_token_logprobs=batch.output_token_logprobs,
            top_logprobs_nums=top_ns or (), top_logprob_ids=batch.top_logprob_ids,
            top_logprob_vals=batch.top_logprob_vals, prompt_logprobs=batch.prompt_logprobs,
            embeddings=batch.embeddings)
        if any(ftypes):
            fins = batch.finish_reasons
            wire = [_EMPTY_FIN] * n
            for i, f in enumerate(ftypes):
                if f:
                    body = fins[i].SerializeToString()
                    wire[i] = _FIN_TAG + _varint(len(body)) + body
            out.MergeFromString(b"".join(wire))
        else:
            out.MergeFromString(_EMPTY_FIN * n)
        return {tids[0]: out}
    return _group_rows(batch, rids, texts, errors, top_ns)


def _group_rows(batch, rids, texts, errors, top_ns) -> dict[str, detokenizer_pb2.BatchStrOutput]:
    """Rows split between tokenizers, or with error rows: each tokenizer's rows gathered column
    by column (``ringserve.columns``), in batch order."""
    n = len(rids)
    groups: dict[str, list[int]] = {}
    for i, tid in enumerate(batch.tokenizer_ids):
        if i not in errors or errors[i] is not None:  # None: a row already answered, dropped
            groups.setdefault(tid, []).append(i)
    counts = list(batch.new_token_counts)
    # A missing column reads as zeros. A row without a state has no known top-k width (0).
    lp_counts = list(batch.logprob_counts) if len(batch.logprob_counts) == n else [0] * n
    top = top_ns or [0] * n
    usage = [list(col) if len(col) == n else [0] * n
             for col in (batch.prompt_tokens, batch.completion_tokens, batch.cached_tokens)]
    ids_at = columns.offsets(counts)
    lp_at = columns.offsets(lp_counts)
    top_at = columns.offsets(lp_counts, top)
    fins = batch.finish_reasons if len(batch.finish_reasons) == n else None
    prompt = {p.row: p for p in batch.prompt_logprobs}
    embeddings = {e.row: e for e in batch.embeddings}
    out: dict[str, detokenizer_pb2.BatchStrOutput] = {}
    for tid, rows in groups.items():
        pick = itemgetter(*rows) if len(rows) > 1 else lambda col, i=rows[0]: (col[i],)
        o = out[tid] = detokenizer_pb2.BatchStrOutput(
            rids=pick(rids), texts=pick(texts), new_token_counts=pick(counts),
            output_ids=columns.gather(batch.output_ids, ids_at, rows),
            prompt_tokens=pick(usage[0]), completion_tokens=pick(usage[1]), cached_tokens=pick(usage[2]),
            logprob_counts=pick(lp_counts), top_logprobs_nums=pick(top))
        if lp_at[-1]:
            o.output_token_logprobs.extend(columns.gather(batch.output_token_logprobs, lp_at, rows))
        if top_at[-1]:
            o.top_logprob_ids.extend(columns.gather(batch.top_logprob_ids, top_at, rows))
            o.top_logprob_vals.extend(columns.gather(batch.top_logprob_vals, top_at, rows))
        for j, i in enumerate(rows):
            if i in errors:
                o.finish_reasons.append(errors[i])
            elif fins is not None:
                o.finish_reasons.append(fins[i])
            else:
                o.finish_reasons.add()
            if i in prompt:
                o.prompt_logprobs.append(prompt[i])
                o.prompt_logprobs[-1].row = j
            if i in embeddings and i not in errors:  # an error row replaced the request's end
                o.embeddings.append(embeddings[i])
                o.embeddings[-1].row = j
    return out
