"""Rewritten schemas through both real grammar engines on SmolLM2's vocabulary: an exclusive
``oneOf`` and an unknown ``format`` compile, and every output that a random walk over the
allowed tokens finishes validates against the schema as written; a ``oneOf`` not provably
exclusive is refused by both, naming it and its JSON Pointer."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from services.scheduler.policy.grammar_backends import GrammarError, GrammarSpec, load_backend
from services.scheduler.policy.stops import load_eos_ids

SHORT = {"type": "string", "maxLength": 6}
SCHEMAS = {
    "type-disjoint": {"type": "object", "properties": {"v": {"oneOf": [{"type": "boolean"}, SHORT, {"type": "null"}]}},
                      "required": ["v"], "additionalProperties": False},
    "const-discriminated": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "name": SHORT}, "required": ["kind", "name"],
         "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
         "required": ["kind", "good"], "additionalProperties": False}]},
    "enum-discriminated $refs": {
        "$defs": {"c": {"type": "object", "properties": {"unit": {"enum": ["c", "k"]}, "t": {"enum": [1, 2]}},
                        "required": ["unit", "t"], "additionalProperties": False},
                  "f": {"type": "object", "properties": {"unit": {"enum": ["f"]}, "ok": {"type": "boolean"}},
                        "required": ["unit", "ok"], "additionalProperties": False}},
        "type": "array", "items": {"oneOf": [{"$ref": "#/$defs/c"}, {"$ref": "#/$defs/f"}]}, "maxItems": 2},
    "unknown and enforced formats": {"type": "object", "properties": {
        "site": {"type": "string", "format": "url", "maxLength": 8}, "id": {"type": "string", "format": "uuid"}},
        "required": ["site", "id"], "additionalProperties": False},
}


@pytest.fixture(scope="module", params=("llguidance", "xgrammar"))
def backend(request, smollm2_dir, tokenizer):
    return load_backend(request.param, smollm2_dir, 49152, load_eos_ids(smollm2_dir, tokenizer))


def _allowed(bitmask: torch.Tensor) -> list[int]:
    bits = (bitmask[0].view(torch.uint8)[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(-1).nonzero().flatten().tolist()


def walk(backend, compiled, rng: random.Random, max_tokens: int = 120) -> list[int] | None:
    """Token ids a random walk over the grammar's allowed tokens produces until it may end
    and picks EOS (then ended), or None when it has not ended within ``max_tokens``."""
    matcher, ids = backend.matcher(compiled), []
    bitmask = torch.zeros((1, (backend.vocab_size + 31) // 32), dtype=torch.int32)
    for _ in range(max_tokens):
        bitmask.zero_()
        matcher.fill_bitmask(bitmask, 0)
        allowed = _allowed(bitmask)
        assert allowed and matcher.error is None
        eos = [t for t in allowed if t in backend.eos_ids]
        if eos and matcher.may_end and (rng.random() < 0.5 or len(eos) == len(allowed)):
            return ids
        token = rng.choice([t for t in allowed if t not in backend.eos_ids])
        assert matcher.accept_token(token)
        ids.append(token)
    return None


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_finished_output_of_a_rewritten_schema_is_valid(backend, tokenizer, name):
    schema = SCHEMAS[name]
    compiled = backend.compile(GrammarSpec("json_schema", json.dumps(schema)))
    rng, finished = random.Random(name), 0
    for _ in range(12):
        ids = walk(backend, compiled, rng)
        if ids is None:
            continue
        finished += 1
        value = json.loads(tokenizer.decode(ids))
        jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    assert finished >= 6, finished


def test_a_one_of_not_provably_exclusive_is_refused_by_both_engines(backend):
    schema = {"type": "object", "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}}
    with pytest.raises(GrammarError) as info:
        backend.compile(GrammarSpec("json_schema", json.dumps(schema)))
    assert str(info.value).startswith("oneOf at /properties/n is not provably exclusive: branches 0 and 1 "), info.value


def test_xgrammar_refuses_a_keyword_the_rewrite_did_not_reach(backend):
    """An unreferenced ``$defs`` entry is not compiled by llguidance, so the rewrite leaves it;
    xgrammar might compile it, so it refuses what is left anywhere, as it always did."""
    schema = {"$defs": {"x": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "type": "string", "maxLength": 4}
    spec = GrammarSpec("json_schema", json.dumps(schema))
    if backend.name == "llguidance":
        backend.compile(spec)
        return
    with pytest.raises(GrammarError) as info:
        backend.compile(spec)
    assert str(info.value) == "oneOf at /$defs/x is not supported by the xgrammar backend"
