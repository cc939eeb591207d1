"""The schema rewrite the tokenizer validates with and the grammar backends compile: an exclusive
``oneOf`` becomes ``anyOf``, any other is refused naming it and its JSON Pointer; unknown
formats are dropped; unenforceable keywords are refused by name and pointer."""

from __future__ import annotations

import json
import random

import grpc
import jsonschema
import pytest

from ringserve.schema_exclusive import MAX_STEPS
from ringserve.schema_rewrite import ENFORCED_FORMATS, REFUSED_KEYWORDS, SchemaRefused, rewrite_schema
from ringserve.v1 import common_pb2
from services.tokenizer.constraints import resolve_constraint
from services.tokenizer.errors import RequestError


def tagged(tag: object, key: str = "kind", required: bool = True, **props) -> dict:
    """An object schema whose ``key`` is the constant ``tag`` (required unless told)."""
    return {"type": "object", "properties": {key: {"const": tag}, **props}, "required": [key] if required else []}


def rewritten(schema: object) -> object:
    return json.loads(rewrite_schema(json.dumps(schema)))


def refusal(schema: object) -> str:
    with pytest.raises(SchemaRefused) as info:
        rewrite_schema(json.dumps(schema))
    return str(info.value)


CAT = tagged("cat", meows={"type": "boolean"})
DOG = tagged("dog", barks={"type": "integer"})

ACCEPTED = {
    "type-disjoint": {"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": ["null", "boolean"]}]},
    "integer vs fraction const": {"oneOf": [{"type": "integer"}, {"const": 1.5}]},
    "const-discriminated": {"oneOf": [CAT, DOG]},
    "enum-discriminated": {"oneOf": [
        {"type": "object", "properties": {"unit": {"enum": ["c", "k"]}}, "required": ["unit"]},
        {"type": "object", "properties": {"unit": {"enum": ["f", "r"]}}, "required": ["unit"]}]},
    "discriminator required on one side": {"oneOf": [tagged("a"), tagged("b", required=False)]},
    "closed object without the other's required key": {"oneOf": [
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False},
        {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"], "additionalProperties": False}]},
    "$ref branches": {"$defs": {"Cat": CAT, "Dog": DOG}, "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]},
    "values: true is no number": {"oneOf": [{"const": True}, {"const": 1}, {"enum": [None, "1"]}]},
    "nested discriminator": {"oneOf": [
        {"type": "object", "properties": {"meta": {"type": "object", "properties": {"v": {"const": 1}},
                                                   "required": ["v"]}}, "required": ["meta"]},
        {"type": "object", "properties": {"meta": {"type": "object", "properties": {"v": {"const": 2}},
                                                   "required": ["v"]}}, "required": ["meta"]}]},
    "nested oneOf": {"oneOf": [{"oneOf": [CAT, DOG]}, tagged("bird")]},
    "recursive list": {"$defs": {"node": {"oneOf": [{"type": "null"}, {
        "type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}]}},
        "$ref": "#/$defs/node"},
}


@pytest.mark.parametrize("schema", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_an_exclusive_one_of_becomes_any_of_with_nothing_else_changed(schema):
    out = rewritten(schema)
    assert "oneOf" not in json.dumps(out)
    assert json.loads(json.dumps(out).replace('"anyOf"', '"oneOf"')) == schema


@pytest.mark.parametrize("schema", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_the_rewrite_accepts_exactly_the_instances_one_of_does(schema):
    """Every instance from a small pool validates the rewritten schema exactly when it
    validates the original one (jsonschema, the reference implementation)."""
    pool = [None, True, False, 0, 1, 1.0, 1.5, -3, "", "1", "cat", [], [1], {}, {"kind": "cat"}, {"kind": "dog"},
            {"kind": "bird"}, {"kind": "cat", "meows": True}, {"kind": "dog", "barks": 2}, {"unit": "c"},
            {"unit": "f"}, {"a": "x"}, {"b": "x"}, {"a": "x", "b": "y"}, {"meta": {"v": 1}}, {"meta": {"v": 2}},
            {"next": None}, {"next": {"next": None}}, {"next": 1}]
    original, out = jsonschema.Draft202012Validator(schema), jsonschema.Draft202012Validator(rewritten(schema))
    assert [original.is_valid(v) for v in pool] == [out.is_valid(v) for v in pool]
    assert any(original.is_valid(v) for v in pool)


REFUSED_ONE_OF = {
    "integer vs number": ({"properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
                          "/properties/n", "both admit integers"),
    "missing discriminator": ({"oneOf": [CAT, {"type": "object", "properties": {"barks": {"type": "integer"}}}]},
                              "(root)", "both admit objects"),
    "non-required discriminator": ({"properties": {"pet": {"oneOf": [tagged("cat", required=False),
                                                                     tagged("dog", required=False)]}}},
                                   "/properties/pet", "both admit objects"),
    "overlapping enums": ({"oneOf": [{"type": "object", "properties": {"u": {"enum": ["c", "k"]}}, "required": ["u"]},
                                     {"type": "object", "properties": {"u": {"enum": ["k", "f"]}}, "required": ["u"]}]},
                          "(root)", "both admit objects"),
    "untyped branches": ({"oneOf": [{"properties": {"k": {"const": "a"}}, "required": ["k"]},
                                    {"properties": {"k": {"const": "b"}}, "required": ["k"]}]},
                         "(root)", "both admit null"),
    "1 equals 1.0": ({"items": {"oneOf": [{"const": 1}, {"enum": [1.0, 2]}]}}, "/items", "both admit the value 1"),
    "same $ref twice": ({"$defs": {"Cat": CAT}, "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Cat"}]},
                        "(root)", "both admit objects"),
    "$ref it cannot follow": ({"oneOf": [{"$ref": "#cat"}, {"type": "string"}]}, "(root)",
                              "the $ref '#cat' cannot be followed"),
    "$ref under a nested $id": ({"$defs": {"a": {"$id": "https://example.com/a", "type": "string"}},
                                 "oneOf": [{"$ref": "#/$defs/a"}, {"type": "integer"}]}, "(root)",
                                "the schema has a nested $id"),
    "beside anyOf": ({"anyOf": [{"type": "string"}], "oneOf": [{"type": "string"}, {"type": "integer"}]},
                     "(root)", "beside anyOf"),
}


@pytest.mark.parametrize("schema,pointer,why", REFUSED_ONE_OF.values(), ids=REFUSED_ONE_OF.keys())
def test_a_one_of_not_provably_exclusive_is_refused_naming_it_and_its_pointer(schema, pointer, why):
    message = refusal(schema)
    assert message.startswith(f"oneOf at {pointer} "), message
    assert why in message


def test_the_refusal_names_the_two_branches():
    assert refusal({"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "number"}]}) == (
        "oneOf at (root) is not provably exclusive: branches 1 and 2 (/oneOf/1 and /oneOf/2) may both match "
        "(both admit integers); give the branches distinct types, or each a required property with a distinct "
        "const, or use anyOf")


def test_large_unions_are_proved_and_past_the_budget_the_proof_gives_up():
    assert "oneOf" not in rewrite_schema(json.dumps({"oneOf": [tagged(f"t{i}") for i in range(60)]}))
    assert "oneOf" not in rewrite_schema(json.dumps({"oneOf": [{"const": i} for i in range(5000)]}))
    assert refusal({"oneOf": [{"const": i} for i in range(5000)] + [{"enum": ["x", 4999.0]}]}) == (
        "oneOf at (root) is not provably exclusive: branches 4999 and 5000 (/oneOf/4999 and /oneOf/5000) may "
        "both match (both admit the value 4999); give the branches distinct types, or each a required property "
        "with a distinct const, or use anyOf")
    assert f"more than {MAX_STEPS} comparisons" in refusal({"oneOf": [tagged(f"t{i}") for i in range(300)]})


def test_refs_through_a_renamed_one_of_follow_it():
    schema = {"properties": {"a": {"$ref": "#/oneOf/1"}}, "oneOf": [{"type": "string"}, {"type": "object"}]}
    assert rewritten(schema) == {"properties": {"a": {"$ref": "#/anyOf/1"}},
                                 "anyOf": [{"type": "string"}, {"type": "object"}]}


@pytest.mark.parametrize("fmt", ["url", "path", "topic", "int32", "uri-reference", "binary"])
def test_an_unknown_format_is_an_annotation(fmt):
    schema = {"type": "object", "properties": {"x": {"type": "string", "format": fmt, "maxLength": 8},
                                               "format": {"type": "string", "format": fmt}}}
    assert rewritten(schema) == {"type": "object", "properties": {"x": {"type": "string", "maxLength": 8},
                                                                  "format": {"type": "string"}}}


def test_enforced_formats_stay_and_an_unchanged_schema_keeps_its_text():
    for fmt in sorted(ENFORCED_FORMATS):
        text = json.dumps({"type": "string", "format": fmt}, indent=2)
        assert rewrite_schema(text) == text
    assert rewrite_schema("not json") == "not json"  # the engine says why


def test_formats_behind_a_ref_are_found_and_unreferenced_defs_left_alone():
    schema = {"$ref": "#/components/A", "components": {"A": {"type": "string", "format": "url"}},
              "$defs": {"unused": {"not": {}, "format": "url"}}}
    assert rewritten(schema) == {"$ref": "#/components/A", "components": {"A": {"type": "string"}},
                                 "$defs": {"unused": {"not": {}, "format": "url"}}}


@pytest.mark.parametrize("keyword", REFUSED_KEYWORDS)
def test_every_unenforceable_keyword_is_refused_with_its_pointer(keyword):
    schema = {"type": "object", "properties": {"a/b": {"items": {keyword: {}}}}}
    assert refusal(schema) == (f"{keyword} at /properties/a~1b/items is not supported: the grammar engine "
                               "cannot enforce it")


def test_unique_items_false_asserts_nothing_and_is_dropped():
    assert rewritten({"type": "array", "uniqueItems": False}) == {"type": "array"}


def test_a_local_ref_that_names_nothing_is_refused_with_its_pointer():
    assert refusal({"properties": {"a": {"$ref": "#/$defs/missing"}}}) == (
        "$ref at /properties/a names nothing in the schema: Pointer '/$defs/missing' does not exist")


def test_the_tokenizer_refuses_with_a_400_naming_the_field_and_sends_the_rewrite_on():
    c = common_pb2.Constraint(json_schema=json.dumps({"oneOf": [{"type": "integer"}, {"type": "number"}]}),
                              param="response_format")
    with pytest.raises(RequestError) as info:
        resolve_constraint(c)
    assert info.value.status == grpc.StatusCode.INVALID_ARGUMENT
    assert str(info.value).startswith("response_format: oneOf at (root) is not provably exclusive: ")
    out = resolve_constraint(common_pb2.Constraint(json_schema=json.dumps(ACCEPTED["const-discriminated"]),
                                                   param="tool_choice"))
    assert json.loads(out.json_schema) == {"anyOf": [CAT, DOG]} and out.param == "tool_choice"


_VALUES = [None, True, False, 0, 1, 1.0, 2, 1.5, "a", "b", ""]


def _random_schema(rng: random.Random, defs: dict, depth: int = 0) -> dict:
    """A small schema of the keywords the proof reads (types, const, enum, objects, allOf,
    anyOf, oneOf, $ref), over few values so that overlaps are common."""
    pick = rng.randrange(9 if depth < 2 else 4)
    if pick == 0:
        return {"type": rng.sample(["null", "boolean", "integer", "number", "string", "object"], rng.randint(1, 2))}
    if pick == 1:
        return {"const": rng.choice(_VALUES)}
    if pick == 2:
        return {"enum": rng.sample(_VALUES, rng.randint(1, 3))}
    if pick == 3:
        return {}
    if pick in (4, 5):
        names = rng.sample(["a", "b"], rng.randint(0, 2))
        schema: dict = {"properties": {n: _random_schema(rng, defs, depth + 1) for n in names},
                        "required": rng.sample(["a", "b"], rng.randint(0, 2))}
        if rng.random() < 0.7:
            schema["type"] = "object"
        if rng.random() < 0.3:
            schema["additionalProperties"] = False
        return schema
    if pick == 6:
        name = f"d{len(defs)}"
        defs[name] = {}  # reserved before the recursion, which may add its own
        defs[name] = _random_schema(rng, defs, depth + 1)
        return {"$ref": f"#/$defs/{name}"}
    keyword = rng.choice(["allOf", "anyOf", "oneOf"])
    return {keyword: [_random_schema(rng, defs, depth + 1) for _ in range(rng.randint(1, 3))]}


def _instances() -> list:
    objects = [{}] + [{k: v} for k in "ab" for v in _VALUES] + [{"a": x, "b": y} for x in _VALUES for y in _VALUES]
    return _VALUES + [[], [1]] + objects


def test_no_rewrite_lets_an_instance_match_two_branches():
    """Random oneOf schemas: whenever the rewrite accepts one, the rewritten schema accepts
    exactly the instances the original does, over every instance of a pool that covers the
    values the schemas name (jsonschema is the reference)."""
    rng, instances = random.Random(26), _instances()
    accepted = 0
    for _ in range(300):
        defs: dict = {}
        schema = {"oneOf": [_random_schema(rng, defs) for _ in range(rng.randint(2, 3))]}
        if defs:
            schema["$defs"] = defs
        try:
            out = rewritten(schema)
        except SchemaRefused:
            continue
        accepted += 1
        original, anyof = jsonschema.Draft202012Validator(schema), jsonschema.Draft202012Validator(out)
        assert [original.is_valid(v) for v in instances] == [anyof.is_valid(v) for v in instances], schema
    assert accepted > 60
