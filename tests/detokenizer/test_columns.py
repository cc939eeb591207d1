"""The columnar layout (``ringserve.columns``): offsets, split, gather, the checker, and the
detokenizer's per-tokenizer grouping built on them, on hand-made batches with exact values."""

from __future__ import annotations

from ringserve import columns
from ringserve.v1 import common_pb2, detokenizer_pb2
from services.detokenizer.output import group_outputs
from services.detokenizer.servicer import check_batch

STOP, NONE = common_pb2.FINISH_STOP, common_pb2.FINISH_NONE


def batch() -> detokenizer_pb2.BatchTokenIDOutput:
    """Four rows: a has 2 ids with logprobs (2 top each), b none, c 3 ids without logprobs,
    d 1 id with logprobs (1 top); rows a and c belong to t1, b and d to t2."""
    b = detokenizer_pb2.BatchTokenIDOutput(
        rids=["a", "b", "c", "d"], tokenizer_ids=["t1", "t2", "t1", "t2"], new_token_counts=[2, 0, 3, 1],
        output_ids=[10, 11, 20, 21, 22, 30], prompt_tokens=[5, 6, 7, 8], completion_tokens=[2, 0, 3, 1],
        cached_tokens=[0, 1, 2, 3], logprob_counts=[2, 0, 0, 1], output_token_logprobs=[-0.5, -1.0, -2.0],
        top_logprob_ids=[10, 1, 11, 2, 30], top_logprob_vals=[-0.5, -3.0, -1.0, -4.0, -2.0])
    for ftype in (NONE, STOP, NONE, NONE):
        b.finish_reasons.add(type=ftype)
    b.prompt_logprobs.add(row=3, start=1, logprobs=[-7.0], top_n=0)
    return b


def test_offsets_split_gather():
    assert columns.offsets([2, 0, 3, 1]) == [0, 2, 2, 5, 6]
    assert columns.offsets([2, 0, 0, 1], [2, 0, 0, 1]) == [0, 4, 4, 4, 5]
    b = batch()
    assert columns.split(b.output_ids, b.new_token_counts) == [[10, 11], [], [20, 21, 22], [30]]
    assert columns.split(b.top_logprob_ids, b.logprob_counts, [2, 0, 0, 1]) == [[10, 1, 11, 2], [], [], [30]]
    offs = columns.offsets(b.new_token_counts)
    assert columns.gather(b.output_ids, offs, [3, 0]) == [30, 10, 11]
    assert columns.gather(b.output_ids, offs, []) == []


def test_check_names_what_is_wrong():
    assert columns.check(batch(), columns.TOKEN_IDS) is None
    assert columns.check(batch(), columns.TOKEN_IDS, [2, 0, 0, 1]) is None
    cases = [
        (lambda b: b.cached_tokens.pop(), "cached_tokens has 3 entries for 4 rows"),
        (lambda b: b.output_ids.append(1), "new_token_counts (sum 6) do not cover output_ids (7 values)"),
        (lambda b: b.new_token_counts.__setitem__(1, -1), "new_token_counts has a negative count"),
        (lambda b: b.output_token_logprobs.pop(),
         "logprob_counts (sum 3) do not cover output_token_logprobs (2 values)"),
    ]
    for breaks, message in cases:
        b = batch()
        breaks(b)
        assert columns.check(b, columns.TOKEN_IDS) == message
        assert check_batch(b, 100) == message
    assert columns.check(batch(), columns.TOKEN_IDS, [2, 0, 0, 2]) == (
        "logprob_counts times the top logprobs (sum 6) do not cover top_logprob_ids (5 values)")
    b = batch()
    b.top_logprob_vals.pop()
    assert columns.check(b, columns.TOKEN_IDS, [2, 0, 0, 1]) == (
        "logprob_counts times the top logprobs (sum 5) do not cover top_logprob_vals (4 values)")
    # The detokenizer learns the widths per rid: its per-step check leaves them out.
    assert columns.check(b, columns.TOKEN_IDS) is None
    b = batch()
    del b.cached_tokens[:]  # a column may be left out whole
    assert columns.check(b, columns.TOKEN_IDS) is None


def test_check_of_a_text_batch_uses_its_widths():
    out = detokenizer_pb2.BatchStrOutput(rids=["a", "b"], texts=["x", ""], new_token_counts=[1, 1], output_ids=[1, 2],
                                         logprob_counts=[1, 1], output_token_logprobs=[-1.0, -2.0],
                                         top_logprobs_nums=[2, 1], top_logprob_ids=[1, 5, 2],
                                         top_logprob_vals=[-1.0, -3.0, -2.0])
    out.finish_reasons.add()
    out.finish_reasons.add()
    assert columns.check(out, columns.STR) is None
    out.top_logprobs_nums[1] = 2
    assert columns.check(out, columns.STR) == (
        "logprob_counts times top_logprobs_nums (sum 4) do not cover top_logprob_ids (3 values)")


def test_grouping_per_tokenizer_with_errors_and_dropped_rows():
    b = batch()
    texts = ["A", "B", "C", "D"]
    error = common_pb2.FinishReason(type=common_pb2.FINISH_ABORT, message="gone", status="INTERNAL")
    out = group_outputs(b, list(b.rids), texts, [0, STOP, 0, 0], {1: None, 2: error}, [2, 0, 0, 1])
    assert set(out) == {"t1", "t2"}
    t1, t2 = out["t1"], out["t2"]
    assert columns.check(t1, columns.STR) is None and columns.check(t2, columns.STR) is None
    assert (list(t1.rids), list(t1.texts), list(t1.output_ids), list(t1.new_token_counts)) == (
        ["a", "c"], ["A", "C"], [10, 11, 20, 21, 22], [2, 3])
    assert [f.type for f in t1.finish_reasons] == [NONE, common_pb2.FINISH_ABORT]
    assert t1.finish_reasons[1].message == "gone"
    assert (list(t1.logprob_counts), list(t1.output_token_logprobs), list(t1.top_logprobs_nums)) == (
        [2, 0], [-0.5, -1.0], [2, 0])
    assert (list(t1.top_logprob_ids), list(t1.top_logprob_vals)) == ([10, 1, 11, 2], [-0.5, -3.0, -1.0, -4.0])
    assert (list(t1.prompt_tokens), list(t1.completion_tokens), list(t1.cached_tokens)) == ([5, 7], [2, 3], [0, 2])
    # b was dropped (already answered); d keeps its logprobs and its prompt logprobs, renumbered.
    assert (list(t2.rids), list(t2.output_ids), list(t2.output_token_logprobs), list(t2.top_logprob_ids)) == (
        ["d"], [30], [-2.0], [30])
    assert [(p.row, list(p.logprobs)) for p in t2.prompt_logprobs] == [(0, [-7.0])]
    assert [p.row for p in b.prompt_logprobs] == [3]  # the input batch is left as it was


def test_embeddings_pass_through_renumbered_per_tokenizer():
    """An embedding travels with its row: whole batches keep it as it is, split batches renumber it,
    and a row an error replaced carries none."""
    b = batch()
    b.embeddings.add(row=1, values=[0.5, -0.25])
    b.embeddings.add(row=2, values=[1.0])
    assert check_batch(b, 100) is None
    texts = ["A", "B", "C", "D"]
    out = group_outputs(b, list(b.rids), texts, [0, STOP, 0, 0], {}, [2, 0, 0, 1])
    assert [(e.row, list(e.values)) for e in out["t1"].embeddings] == [(1, [1.0])]
    assert [(e.row, list(e.values)) for e in out["t2"].embeddings] == [(0, [0.5, -0.25])]
    error = common_pb2.FinishReason(type=common_pb2.FINISH_ABORT, message="gone", status="INTERNAL")
    out = group_outputs(b, list(b.rids), texts, [0, STOP, 0, 0], {2: error}, [2, 0, 0, 1])
    assert not out["t1"].embeddings
    one = detokenizer_pb2.BatchTokenIDOutput(rids=["e"], tokenizer_ids=["t1"], new_token_counts=[0],
                                             prompt_tokens=[3], completion_tokens=[0], cached_tokens=[0])
    one.finish_reasons.add(type=common_pb2.FINISH_LENGTH)
    one.embeddings.add(row=0, values=[0.125])
    whole = group_outputs(one, ["e"], [""], [common_pb2.FINISH_LENGTH], {}, None)["t1"]
    assert [(e.row, list(e.values)) for e in whole.embeddings] == [(0, [0.125])]
    b.embeddings.add(row=4, values=[])
    assert check_batch(b, 100) == "a PooledEmbedding names row 4 of 4"
