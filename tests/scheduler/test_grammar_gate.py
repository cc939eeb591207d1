"""Where a grammar applies under a reasoning parser, and what a stop token id does under one.

The gate and the masks are checked without the model (fake matchers with a known allowed
set); engine tests on SmolLM2 show a grammar starting at once when the output does not open
with the reasoning tag and waiting for the end tag when it does, and a stop id never
cutting a structured output.
"""

from __future__ import annotations

import re

import pytest
import torch

from services.scheduler.policy.grammar import accept_grammar_tokens, apply_grammar_masks
from services.scheduler.policy.grammar_backends import GrammarSpec
from services.scheduler.policy.grammar_gate import ACTIVE, DECIDING, REASONING, GrammarGate
from services.scheduler.policy.req import FinishType, Req, ReqInput, SamplingParams
from services.scheduler.policy.stops import StopChecker

IPV4 = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"
VOCAB = 100


class _Grammar:
    """A matcher allowing ``allowed``; it may end once it has taken ``end_after`` tokens."""

    error = None

    def __init__(self, allowed: list[int], end_after: int = 1 << 30):
        self.allowed, self.end_after, self.taken = allowed, end_after, []

    def fill_bitmask(self, bitmask, row):
        view = bitmask[row].view(torch.uint8)
        for t in self.allowed:
            view[t // 8] |= 1 << (t % 8)

    def accept_token(self, token):
        self.taken.append(token)
        return token in self.allowed

    @property
    def may_end(self):
        return len(self.taken) >= self.end_after

    ended = False


def _req(grammar=None, starts_after=(), opens_with=(), stop_token_ids=()) -> Req:
    spec = GrammarSpec("regex", "x", "response_format", tuple(starts_after), tuple(opens_with))
    req = Req(ReqInput(rid="r", input_ids=[1, 2], grammar=spec,
                       sampling=SamplingParams(stop_token_ids=frozenset(stop_token_ids))))
    req.grammar = grammar
    return req


def _allowed(req: Req) -> list[int]:
    logits = torch.zeros(1, VOCAB)
    assert apply_grammar_masks(logits, [req]) == []
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def _sample(req: Req, token: int) -> None:
    req.append_output(token)
    accept_grammar_tokens([req])


def test_the_gate_opens_the_reasoning_only_on_a_first_token_that_is_the_tag():
    think, end = (7,), (8, 9)
    gate = GrammarGate(end, think)
    assert (gate.state, gate.extra_token, gate.masks) == (DECIDING, 7, True)
    assert gate.advance([7]) is False and gate.state == REASONING and not gate.masks
    assert [gate.advance(ids) for ids in ([7, 8], [7, 8, 5], [7, 8, 5, 8], [7, 8, 5, 8, 9])] == [False] * 4
    assert gate.state == ACTIVE and gate.advance([7, 8, 5, 8, 9, 3]) is True
    answered = GrammarGate(end, think)
    assert answered.advance([3]) is True and answered.state == ACTIVE  # no think block: the grammar's first token
    assert GrammarGate(end, (4, 5, 6)).state == ACTIVE  # a tag spelled in several tokens never opens it
    assert GrammarGate(end, ()).state == REASONING  # the prompt opened the reasoning
    assert GrammarGate((), ()).state == ACTIVE  # no reasoning parser


def test_the_first_mask_is_the_grammars_plus_the_tag_and_the_tags_are_no_grammar_input():
    req = _req(_Grammar([10, 11]), starts_after=(8, 9), opens_with=(4,))
    assert _allowed(req) == [4, 10, 11]
    _sample(req, 4)
    assert _allowed(req) == list(range(VOCAB))  # reasoning: free
    for t in (30, 8, 9):
        _sample(req, t)
    assert _allowed(req) == [10, 11] and req.grammar.taken == []
    _sample(req, 11)
    assert req.grammar.taken == [11]
    answered = _req(_Grammar([10, 11]), starts_after=(8, 9), opens_with=(4,))
    _sample(answered, 10)
    assert answered.gate.state == ACTIVE and answered.grammar.taken == [10]
    assert _allowed(answered) == [10, 11]
    spelled = _req(_Grammar([10, 11]), starts_after=(8, 9), opens_with=(4, 5, 6))
    assert _allowed(spelled) == [10, 11]


def test_stop_ids_are_allowed_and_stop_only_where_the_grammar_may_end(tokenizer):
    checker = StopChecker(tokenizer, frozenset({2}), context_length=1000)
    req = _req(_Grammar([10, 11, 12], end_after=2), stop_token_ids=(11, 40))
    assert _allowed(req) == [10, 11, 12]  # 11 is text here; 40 (no grammar text) stays masked
    for t in (11, 10):  # a stop id the grammar took as text does not cut the output
        req.append_output(t)
        checker.check([req])
        accept_grammar_tokens([req])
        assert not req.finished
    assert req.grammar.may_end and _allowed(req) == [10, 11, 12, 40]
    req.append_output(40)
    checker.check([req])
    accept_grammar_tokens([req])
    assert (req.finish_reason.type, req.finish_reason.matched_token_id) == (FinishType.STOP, 40)
    assert req.grammar.taken == [11, 10]  # the stop id is not grammar text
    plain = Req(ReqInput(rid="p", input_ids=[1], sampling=SamplingParams(stop_token_ids=frozenset({11}))))
    plain.append_output(11)
    checker.check([plain])
    assert plain.finish_reason.matched_token_id == 11  # without a grammar a stop id always stops


@pytest.fixture(scope="module")
def engine(make_engine):
    engine = make_engine()
    assert engine.grammars.backend.name == "llguidance"  # loaded now, not inside a request's compile budget
    return engine


def _constrained(rid, ids, spec, max_new_tokens=40, **kw):
    return ReqInput(rid=rid, input_ids=ids, grammar=spec,
                    sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kw))


def test_the_grammar_applies_at_once_unless_the_output_opens_with_the_tag(engine, run_all, chat_ids, greedy_req,
                                                                          tokenizer):
    prompt = chat_ids("What is the IP address of the local host?")
    engine.add_request(greedy_req("free", prompt, 8, ignore_eos=True))
    free = run_all(engine)["free"].output_ids
    # A one-token tag the model does not open with ("</" of "</think>"): the grammar shapes
    # the whole output.
    end = tuple(tokenizer.encode("</think>", add_special_tokens=False).ids)
    spec = GrammarSpec("regex", IPV4, "response_format", starts_after=end, opens_with=end[:1])
    engine.add_request(_constrained("answer", prompt, spec))
    out = run_all(engine)["answer"]
    assert re.fullmatch(IPV4, tokenizer.decode(out.output_ids)), tokenizer.decode(out.output_ids)
    assert out.finish.type == FinishType.STOP
    # The model's own first token as the opening tag, its next two as the end tag: reasoning,
    # then the grammar.
    spec = GrammarSpec("regex", IPV4, "response_format", starts_after=tuple(free[1:3]), opens_with=(free[0],))
    engine.add_request(_constrained("think", prompt, spec))
    out = run_all(engine)["think"]
    assert out.output_ids[:3] == free[:3]
    assert re.fullmatch(IPV4, tokenizer.decode(out.output_ids[3:])), tokenizer.decode(out.output_ids)
    assert out.finish.type == FinishType.STOP
    assert engine.reqs == {} and engine.req_pool.used == 0


def test_a_stop_id_never_cuts_a_structured_output_and_ends_it_where_it_may(engine, run_all, chat_ids, tokenizer):
    prompt = chat_ids("How many legs does a spider have?")
    spec = GrammarSpec("regex", "[0-9]{1,3} legs", "structured_outputs.regex")
    engine.add_request(_constrained("whole", prompt, spec))
    whole = run_all(engine)["whole"]
    assert whole.finish.type == FinishType.STOP and whole.finish.matched_token_id is None
    # Every token of the answer as a stop id: none of them cuts it.
    engine.add_request(_constrained("ids", prompt, spec, stop_token_ids=frozenset(whole.output_ids)))
    cut = run_all(engine)["ids"]
    assert (cut.output_ids, cut.finish.type) == (whole.output_ids, FinishType.STOP)
    # A stop id that is no grammar text, pushed by logit_bias: allowed (and stopping) only
    # where the grammar may end, after " legs".
    stop = tokenizer.token_to_id("<|endoftext|>")
    spec = GrammarSpec("regex", "[0-9]{1,3} legs( and more)?", "structured_outputs.regex")
    engine.add_request(_constrained("bias", prompt, spec, stop_token_ids=frozenset({stop}),
                                    logit_bias=((stop, 100.0),)))
    out = run_all(engine)["bias"]
    assert out.output_ids[-1] == stop
    assert re.fullmatch("[0-9]{1,3} legs", tokenizer.decode(out.output_ids[:-1])), tokenizer.decode(out.output_ids)
    assert (out.finish.type, out.finish.matched_token_id) == (FinishType.STOP, stop)
