"""Constrained decoding in the engine: masks on constrained rows only, the grammar ends the
request, compile errors and timeouts end it with INVALID_ARGUMENT and free everything."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from services.scheduler.policy.grammar import GrammarManager
from services.scheduler.policy.grammar_backends import GrammarError, GrammarSpec
from services.scheduler.policy.req import FinishType, Req, ReqInput, SamplingParams

SCHEMA_S06 = {
    "type": "object",
    "properties": {"guard": {"const": "SCHEMA_ENFORCED"}, "answer": {"type": "integer"}},
    "required": ["guard", "answer"],
    "additionalProperties": False,
}
IPV4 = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"
BACKENDS = ("llguidance", "xgrammar")


def constrained(rid: str, ids: list[int], spec: GrammarSpec, max_new_tokens: int = 64, **kw) -> ReqInput:
    return ReqInput(rid=rid, input_ids=ids, grammar=spec,
                    sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kw))


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request, make_engine):
    return make_engine(grammar_backend=request.param)


def test_json_schema_is_enforced_and_plain_rows_are_untouched(engine, run_all, chat_ids, greedy_req, tokenizer):
    plain_prompt = chat_ids("Repeat exactly: The quick brown fox jumps.")
    engine.add_request(greedy_req("solo", plain_prompt, 24))
    solo = run_all(engine)["solo"].output_ids
    engine.add_request(greedy_req("plain", plain_prompt, 24))
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA_S06), "response_format")
    engine.add_request(constrained("json", chat_ids("Answer in one English sentence: what is 19+4?"), spec))
    results = run_all(engine)
    assert results["plain"].output_ids == solo
    out = results["json"]
    assert out.finish.type == FinishType.STOP
    value = json.loads(tokenizer.decode(out.output_ids))
    jsonschema.validate(value, SCHEMA_S06)
    assert value["guard"] == "SCHEMA_ENFORCED"
    assert engine.req_pool.used == 0 and engine.reqs == {} and engine.grammars.num_pending == 0


def test_regex_ends_the_request_when_complete(engine, run_all, chat_ids, tokenizer):
    engine.add_request(constrained("ip", chat_ids("What is the IP address of the local host?"),
                                   GrammarSpec("regex", IPV4, "structured_outputs.regex"), max_new_tokens=32))
    out = run_all(engine)["ip"]
    text = tokenizer.decode(out.output_ids)
    assert re.fullmatch(IPV4, text), text
    assert out.finish.type == FinishType.STOP and len(out.output_ids) < 32


@pytest.mark.parametrize("spec,fragment", [
    (GrammarSpec("regex", "[", "structured_outputs.regex"), "structured_outputs.regex: the constraint cannot be used"),
    (GrammarSpec("regex", "(a", "regex"), "regex: the constraint cannot be used"),
    (GrammarSpec("json_schema", '{"type": "strin"}', "response_format"), "response_format: the constraint cannot"),
    (GrammarSpec("json_schema", '{"$ref": "#/$defs/missing"}', "response_format"), "response_format: the constr"),
    (GrammarSpec("ebnf", "root ::= foo", "ebnf"), "ebnf: the constraint cannot be used"),
])
def test_uncompilable_constraint_aborts_with_invalid_argument(engine, run_all, chat_ids, spec, fragment):
    engine.add_request(constrained("bad", chat_ids("Hi"), spec))
    out = run_all(engine)["bad"]
    assert out.finish.type == FinishType.ABORT
    assert out.finish.status == "INVALID_ARGUMENT"
    assert out.finish.message.startswith(fragment), out.finish.message
    assert out.output_ids == []
    assert engine.reqs == {} and engine.req_pool.used == 0 and engine.load().num_waiting_reqs == 0


def test_one_of_is_refused_by_name_not_weakened(engine, run_all, chat_ids):
    schema = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    engine.add_request(constrained("oneof", chat_ids("Hi"), GrammarSpec("json_schema", json.dumps(schema))))
    out = run_all(engine)["oneof"]
    assert out.finish.status == "INVALID_ARGUMENT"
    assert "oneOf" in out.finish.message


class _SlowBackend:
    name = "slow"
    vocab_size = 64
    eos_ids = frozenset({0})

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.compiled = 0

    def compile(self, spec):
        time.sleep(self.seconds)
        self.compiled += 1
        if spec.text == "bad":
            raise GrammarError("bad grammar")
        return spec.text

    def matcher(self, compiled):
        return _FixedMask([1, 2], name=compiled)


def _req(rid: str) -> Req:
    return Req(ReqInput(rid=rid, input_ids=[1, 2]))


def _wait(manager: GrammarManager, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        ready, failed = manager.take_ready()
        if ready or failed:
            return ready, failed
        time.sleep(0.01)
    return [], []


def test_compile_budget_ends_a_request_that_waits_too_long():
    manager = GrammarManager(lambda: _SlowBackend(0.5), compile_timeout_s=0.1)
    manager.submit(_req("a"), GrammarSpec("regex", "x", "response_format"))
    ready, failed = _wait(manager, 2)
    assert ready == []
    assert [(r.rid, status) for r, _, status in failed] == [("a", "INVALID_ARGUMENT")]
    assert "did not compile within 0.1 s (--grammar-compile-timeout)" in failed[0][1]
    assert manager.num_pending == 0


def test_identical_constraints_share_one_compile_and_the_cache_is_bounded():
    backend = _SlowBackend(0.05)
    manager = GrammarManager(lambda: backend, compile_timeout_s=5, cache_size=2)
    spec = GrammarSpec("regex", "x")
    a, b = _req("a"), _req("b")
    manager.submit(a, spec)
    manager.submit(b, spec)
    time.sleep(0.3)
    ready, failed = manager.take_ready()
    assert sorted(r.rid for r in ready) == ["a", "b"] and failed == []
    assert backend.compiled == 1 and a.grammar.name == "x"
    for text in ("y", "z"):
        manager.submit(_req(text), GrammarSpec("regex", text))
    assert list(manager._cache) == [("regex", "y"), ("regex", "z")]
    manager.submit(_req("bad"), GrammarSpec("regex", "bad", "structured_outputs.grammar"))
    time.sleep(0.5)
    _, failed = manager.take_ready()
    assert [m for _, m, _ in failed] == ["structured_outputs.grammar: the constraint cannot be used: bad grammar"]


def test_abort_while_compiling_frees_the_request(make_engine, run_all, chat_ids):
    engine = make_engine()
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA_S06))
    engine.add_request(constrained("c", chat_ids("Hi"), spec))
    assert engine.load().num_waiting_reqs == 1 and engine.req_pool.used == 0
    assert engine.abort("c") == 1
    out = run_all(engine)["c"]
    assert out.finish.type == FinishType.ABORT and out.finish.status == "CANCELLED"
    assert engine.reqs == {} and engine.grammars.num_pending == 0 and engine.load().num_waiting_reqs == 0


class _FixedMask:
    """A matcher that allows a fixed set of tokens."""

    error = None
    may_end = ended = False

    def __init__(self, allowed: list[int], name: str = ""):
        self.allowed = allowed
        self.name = name

    def fill_bitmask(self, bitmask, row):
        for t in self.allowed:
            word = bitmask[row, t // 32].item() & 0xFFFFFFFF | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def accept_token(self, token):
        return token in self.allowed


def test_masks_touch_only_constrained_rows_and_allow_exactly_the_set():
    import torch

    from services.scheduler.policy.grammar import apply_grammar_masks

    vocab = 100
    logits = torch.arange(3 * vocab, dtype=torch.float32).reshape(3, vocab)
    before = logits.clone()
    reqs = [_req("a"), _req("b"), _req("c")]
    reqs[0].grammar = _FixedMask([0, 31, 32, 63, 99])
    reqs[2].grammar = _FixedMask([5])
    assert apply_grammar_masks(logits, reqs) == []
    out = logits
    assert torch.equal(out[1], before[1])
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 31, 32, 63, 99]
    assert torch.equal(out[0, [0, 31, 32, 63, 99]], before[0, [0, 31, 32, 63, 99]])
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [5]
    reqs[1].grammar = _FixedMask([7])
    all_rows = before.clone()
    apply_grammar_masks(all_rows, reqs)
    assert [torch.isfinite(r).nonzero().flatten().tolist() for r in all_rows] == [[0, 31, 32, 63, 99], [7], [5]]


def test_chunked_prefill_samples_the_constrained_row_only_at_the_prompt_end(make_engine, run_all, chat_ids, tokenizer):
    prompt = chat_ids("Answer in one English sentence: what is 19+4? " + "Think about it carefully. " * 6)
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA_S06))
    whole = make_engine()
    whole.add_request(constrained("w", prompt, spec))
    want = run_all(whole)["w"].output_ids
    chunked = make_engine(chunked_prefill_size=16)
    chunked.add_request(constrained("c", prompt, spec))
    got = run_all(chunked)["c"]
    assert len(prompt) > 3 * 16
    assert got.output_ids == want and got.finish.type == FinishType.STOP
    jsonschema.validate(json.loads(tokenizer.decode(got.output_ids)), SCHEMA_S06)


def test_eos_stays_masked_until_the_grammar_may_end(engine, tokenizer):
    import torch

    from services.scheduler.policy.grammar import apply_grammar_masks

    backend = engine.grammars.backend
    req = _req("eos")
    req.grammar = backend.matcher(backend.compile(GrammarSpec("regex", "ab(c)?")))
    eos = 2  # SmolLM2's <|im_end|>
    masked = torch.zeros(1, engine.vocab_size)
    apply_grammar_masks(masked, [req])
    assert masked[0, eos] == float("-inf")
    for t in tokenizer.encode("ab", add_special_tokens=False).ids:
        assert req.grammar.accept_token(t)
    masked = torch.zeros(1, engine.vocab_size)
    apply_grammar_masks(masked, [req])
    assert masked[0, eos] == 0.0  # "ab" may end here, or go on with "c"
    assert masked[0, tokenizer.token_to_id("c")] == 0.0
    assert not req.grammar.ended


def test_grammar_that_starts_after_a_tag_leaves_the_output_free_until_it(engine, run_all, chat_ids, greedy_req,
                                                                        tokenizer):
    # The "reasoning" is what the model says unconstrained; its first two tokens stand for the
    # end tag (a reasoning model's "</think>"): the regex applies from the third token on.
    prompt = chat_ids("What is the IP address of the local host?")
    engine.add_request(greedy_req("free", prompt, 8, ignore_eos=True))
    free = run_all(engine)["free"].output_ids
    tag = tuple(free[:2])
    spec = GrammarSpec("regex", IPV4, "response_format", starts_after=tag)
    engine.add_request(constrained("after", prompt, spec, max_new_tokens=40))
    out = run_all(engine)["after"]
    assert tuple(out.output_ids[:2]) == tag  # unconstrained up to and with the tag
    text = tokenizer.decode(out.output_ids[2:])
    assert re.fullmatch(IPV4, text), text
    assert out.finish.type == FinishType.STOP
    # A tag the output never produces: the grammar never applies and the output is the free one.
    never = GrammarSpec("regex", IPV4, "response_format", starts_after=(49151, 49150))
    engine.add_request(constrained("never", prompt, never, max_new_tokens=8, ignore_eos=True))
    assert run_all(engine)["never"].output_ids == free
    assert engine.req_pool.used == 0 and engine.reqs == {}
