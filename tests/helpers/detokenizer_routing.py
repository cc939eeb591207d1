"""A detokenizer servicer's stand-in manager and its input rows, with no vocabulary."""

from __future__ import annotations

from ringserve.v1 import detokenizer_pb2


class RoutingManager:
    """A DetokenizerManager stand-in: each batch's rids become one text row for its tokenizer id."""

    num_decode_states = 0

    def handle_batch(self, batch: detokenizer_pb2.BatchTokenIDOutput) -> dict[str, detokenizer_pb2.BatchStrOutput]:
        out: dict[str, detokenizer_pb2.BatchStrOutput] = {}
        for rid, tokenizer_id in zip(batch.rids, batch.tokenizer_ids, strict=True):
            out.setdefault(tokenizer_id, detokenizer_pb2.BatchStrOutput()).rids.append(rid)
        return out


def rows(rid: str, tokenizer_id: str) -> detokenizer_pb2.BatchTokenIDOutput:
    return detokenizer_pb2.BatchTokenIDOutput(rids=[rid], tokenizer_ids=[tokenizer_id])
