"""A grammar engine's failure is an error of that request, never a fail-open or a 500.

Checked at the grammar layer with both real engines (they read only tokenizer.json) and
with fake matchers whose failure point is known; one engine test on SmolLM2 shows a grammar
failing mid-output ending its own request while a plain one beside it runs on untouched.
"""

from __future__ import annotations

import time

import pytest
import torch

from services.scheduler.policy.grammar import GrammarManager, accept_grammar_tokens, apply_grammar_masks
from services.scheduler.policy.grammar_backends import GrammarSpec, load_backend
from services.scheduler.policy.req import FinishType, Req, ReqInput, SamplingParams
from services.scheduler.policy.stops import load_eos_ids
from services.tokenizer.constraints import choice_grammar

ROW_LIMIT = ("Parser Error: Current row has 2501 items; max is 2000; consider making your grammar left-recursive "
             "if it's right-recursive")


class _Failing:
    """A matcher allowing every token, in an error state from its ``fail_at``-th mask on
    (``error_text`` None: it allows nothing there instead)."""

    may_end = ended = False

    def __init__(self, fail_at: int, error_text: str | None = "engine limit"):
        self.fail_at, self.error_text, self.masks = fail_at, error_text, 0

    def fill_bitmask(self, bitmask, row):
        self.masks += 1
        if self.masks < self.fail_at:
            bitmask[row] = -1
        elif self.error_text is None:
            bitmask[row] = 0

    @property
    def error(self):
        return self.error_text if self.masks >= self.fail_at else None

    def accept_token(self, token):
        return True


class _FakeBackend:
    name = "fake"
    vocab_size = 49152
    eos_ids = frozenset({2})

    def compile(self, spec):
        return spec.text

    def matcher(self, compiled):
        return _Failing(int(compiled))


def _req(rid: str, grammar=None, param: str = "response_format") -> Req:
    req = Req(ReqInput(rid=rid, input_ids=[1, 2], grammar=GrammarSpec("regex", "x", param)))
    req.grammar = grammar
    return req


def test_an_error_state_or_an_empty_mask_fails_that_row_only_and_leaves_it_unmasked():
    reqs = [_req("err", _Failing(1), "structured_outputs.regex"), _req("plain"), _req("empty", _Failing(1, None)),
            _req("ok", _Failing(5))]
    logits = torch.zeros(4, 64)
    failed = apply_grammar_masks(logits, reqs)
    assert [(r.rid, m) for r, m in failed] == [
        ("err", "structured_outputs.regex: the grammar engine failed at output token 1: engine limit; "
                "simplify the constraint"),
        ("empty", "response_format: the grammar engine failed at output token 1: no token is allowed; "
                  "simplify the constraint"),
    ]
    assert bool(torch.isfinite(logits).all())  # failed rows are sampled from everything, then dropped


@pytest.fixture(scope="module", params=("llguidance", "xgrammar"))
def backend(request, smollm2_dir, tokenizer):
    return load_backend(request.param, smollm2_dir, 49152, load_eos_ids(smollm2_dir, tokenizer))


def test_a_token_the_grammar_does_not_take_ends_the_request_with_invalid_argument(backend, tokenizer):
    req = _req("r", backend.matcher(backend.compile(GrammarSpec("regex", "ab"))), "structured_outputs.regex")
    req.append_output(tokenizer.token_to_id("z"))
    accept_grammar_tokens([req])
    assert (req.finish_reason.type, req.finish_reason.status) == (FinishType.ABORT, "INVALID_ARGUMENT")
    assert req.finish_reason.message.startswith("structured_outputs.regex: the grammar engine failed at output "
                                                "token 1: "), req.finish_reason.message


def _wait(manager: GrammarManager):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready, failed = manager.take_ready()
        if ready or failed:
            return ready, failed
        time.sleep(0.01)
    raise AssertionError("no compile finished")


def test_a_grammar_that_fails_at_its_first_step_is_refused_at_admission(backend):
    manager = GrammarManager(lambda: backend, compile_timeout_s=30)
    # 2,500 alternatives in one rule: llguidance's Earley row holds at most 2,000.
    alternatives = GrammarSpec("ebnf", choice_grammar([f"option number {i}" for i in range(2500)]),
                               "structured_outputs.grammar")
    manager.submit(_req("alts"), alternatives)
    ready, failed = _wait(manager)
    if backend.name == "xgrammar":  # a pushdown automaton: no such limit
        assert [r.rid for r in ready] == ["alts"] and failed == []
        return
    assert [(r.rid, m, s) for r, m, s in failed] == [
        ("alts", "structured_outputs.grammar: the constraint cannot be used: the grammar fails at its first token: "
                 + ROW_LIMIT, "INVALID_ARGUMENT")]
    manager.submit(_req("count"), GrammarSpec("regex", "a{300000}", "regex"))
    _, failed = _wait(manager)
    assert [m for _, m, _ in failed] == [
        "regex: the constraint cannot be used: the grammar fails at its first token: lexer error: too many "
        "expressions constructed"]
    assert manager.num_pending == 0


def test_a_grammar_failing_mid_output_ends_its_request_and_the_batch_goes_on(make_engine, run_all, chat_ids,
                                                                            greedy_req):
    engine = make_engine()
    engine.grammars._backend = _FakeBackend()
    prompt = chat_ids("Count from one to ten in words.")
    engine.add_request(greedy_req("solo", prompt, 12))
    solo = run_all(engine)["solo"].output_ids
    engine.add_request(greedy_req("plain", prompt, 12))
    engine.add_request(ReqInput(rid="g", input_ids=prompt, grammar=GrammarSpec("regex", "3", "response_format"),
                                sampling=SamplingParams(temperature=0.0, max_new_tokens=12)))
    results = run_all(engine)
    assert results["plain"].output_ids == solo
    g = results["g"]
    assert len(g.output_ids) == 2  # two tokens under a working grammar, none from the failed mask
    assert (g.finish.type, g.finish.status) == (FinishType.ABORT, "INVALID_ARGUMENT")
    assert g.finish.message == ("response_format: the grammar engine failed at output token 3: engine limit; "
                                "simplify the constraint")
    assert engine.reqs == {} and engine.req_pool.used == 0 and engine.load().num_running_reqs == 0
