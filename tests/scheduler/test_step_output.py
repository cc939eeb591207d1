"""The scheduler's writer of the columnar layout (``StepOutput``), read back with the shared
reader and checker (``ringserve.columns``), with no model."""

from __future__ import annotations

from ringserve import columns
from services.scheduler.policy.output import StepOutput
from services.scheduler.policy.req import FinishReason, FinishType, Req, ReqInput
from services.scheduler.wire import step_output_to_proto


def test_rows_written_by_the_scheduler_read_back_exactly():
    a = Req(ReqInput(rid="a", input_ids=[1, 2, 3], tokenizer_id="t1", return_logprob=True, top_logprobs_num=2))
    b = Req(ReqInput(rid="b", input_ids=[4], tokenizer_id="t2"))
    c = Req(ReqInput(rid="c", input_ids=[5, 6], tokenizer_id="t1", return_logprob=True, top_logprobs_num=0))
    out = StepOutput()
    for req, ids in ((a, [7, 8]), (b, []), (c, [9])):
        for t in ids:
            req.append_output(t)
    b.finish_reason = FinishReason(FinishType.LENGTH)
    out.add_row(a, [7, 8])
    out.add_logprobs(-0.5, [7, 3], [-0.5, -2.0])
    out.add_logprobs(-1.0, [8, 3], [-1.0, -2.5])
    out.add_row(b, [])
    out.add_row(c, [9])
    out.add_logprobs(-0.25, [], [])
    widths = [2, 0, 0]
    msg = step_output_to_proto(out)
    assert columns.check(out, columns.TOKEN_IDS, widths) is None
    assert columns.check(msg, columns.TOKEN_IDS, widths) is None
    assert columns.split(msg.output_ids, msg.new_token_counts) == [[7, 8], [], [9]]
    assert columns.split(msg.output_token_logprobs, msg.logprob_counts) == [[-0.5, -1.0], [], [-0.25]]
    assert columns.split(msg.top_logprob_ids, msg.logprob_counts, widths) == [[7, 3, 8, 3], [], []]
    assert [i.row for i in msg.inits] == [0, 1, 2] and msg.inits[0].prompt_tail_ids == [1, 2, 3]
    assert [f.type for f in msg.finish_reasons] == [0, int(FinishType.LENGTH), 0]
    assert (list(msg.completion_tokens), list(msg.prompt_tokens)) == ([2, 0, 1], [3, 1, 2])
