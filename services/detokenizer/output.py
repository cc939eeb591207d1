"""BatchStrOutput assembly: one message per owning tokenizer instance per step."""

from __future__ import annotations

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
    """One BatchStrOutput per tokenizer instance, passing ids, counts and logprobs through.

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
            top_logprob_vals=batch.top_logprob_vals, prompt_logprobs=batch.prompt_logprobs)
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
    """Rows split between tokenizers, or with error rows: column by column, row by row."""
    out: dict[str, detokenizer_pb2.BatchStrOutput] = {}
    n = len(rids)
    counts = batch.new_token_counts
    fins = batch.finish_reasons
    lp_counts = batch.logprob_counts if len(batch.logprob_counts) == n else [0] * n
    pos = lp_pos = top_pos = 0
    prompt = {p.row: p for p in batch.prompt_logprobs}
    for i in range(n):
        c = counts[i]
        lc = lp_counts[i]
        # A row without a state has no known top-k width (0); only its own slice is lost.
        top_n = top_ns[i] if top_ns else 0
        if not (i in errors and errors[i] is None):
            tid = batch.tokenizer_ids[i]
            o = out.get(tid)
            if o is None:
                o = out[tid] = detokenizer_pb2.BatchStrOutput()
            o.rids.append(rids[i])
            o.texts.append(texts[i])
            o.new_token_counts.append(c)
            o.output_ids.extend(batch.output_ids[pos:pos + c])
            if i in errors:
                o.finish_reasons.append(errors[i])
            elif len(fins) == n:
                o.finish_reasons.append(fins[i])
            else:
                o.finish_reasons.add()
            for src, dst in ((batch.prompt_tokens, o.prompt_tokens),
                             (batch.completion_tokens, o.completion_tokens),
                             (batch.cached_tokens, o.cached_tokens)):
                dst.append(src[i] if len(src) == n else 0)
            o.logprob_counts.append(lc)
            o.output_token_logprobs.extend(batch.output_token_logprobs[lp_pos:lp_pos + lc])
            o.top_logprobs_nums.append(top_n)
            o.top_logprob_ids.extend(batch.top_logprob_ids[top_pos:top_pos + lc * top_n])
            o.top_logprob_vals.extend(batch.top_logprob_vals[top_pos:top_pos + lc * top_n])
            if i in prompt:
                o.prompt_logprobs.append(prompt[i])
                o.prompt_logprobs[-1].row = len(o.rids) - 1
        pos += c
        lp_pos += lc
        top_pos += lc * top_n
    return out
