"""100 random JSON schemas through the engine (objects, arrays, enums, const, patterns,
min/max items, $ref/$defs, anyOf): every request that finishes with STOP decodes to a value
that validates against its schema, none ends with an internal error; and constrained
requests survive retraction with the same output."""

from __future__ import annotations

import json
import random

import jsonschema

from services.scheduler.policy.grammar_backends import GrammarSpec
from services.scheduler.policy.req import FinishType, ReqInput, SamplingParams

NAMES = ["id", "name", "city", "tags", "score", "ok", "kind", "note"]


def random_schema(rng: random.Random, depth: int = 0, defs: dict | None = None) -> dict:
    """A schema of the supported keywords; ``defs`` collects $defs for $ref."""
    kinds = ["string", "integer", "number", "boolean", "enum", "const", "pattern"]
    if depth < 2:
        kinds += ["object", "object", "array", "anyOf", "ref"]
    kind = rng.choice(kinds)
    if kind in ("string", "integer", "number", "boolean"):
        schema: dict = {"type": kind}
        if kind == "string" and rng.random() < 0.7:
            schema["maxLength"] = rng.randint(1, 12)
        if kind == "integer" and rng.random() < 0.7:
            lo = rng.randint(-50, 50)
            schema.update(minimum=lo, maximum=lo + rng.randint(0, 500))
        if kind == "number":
            schema.update(minimum=0, maximum=100)
        return schema
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, None, True], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["SCHEMA", 42, False, "x y"])}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice([r"^[a-z]{2,6}$", r"^\d{3}-\d{4}$", r"^(yes|no)$"])}
    if kind == "object":
        props = {n: random_schema(rng, depth + 1, defs) for n in rng.sample(NAMES, rng.randint(1, 3))}
        required = [n for n in props if rng.random() < 0.7]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1, defs), "minItems": lo,
                "maxItems": lo + rng.randint(0, 3)}
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth + 1, defs) for _ in range(rng.randint(2, 3))]}
    assert defs is not None
    name = f"d{len(defs)}"
    defs[name] = {}  # reserved before the recursion, which may add its own
    defs[name] = random_schema(rng, depth + 1, defs)
    return {"$ref": f"#/$defs/{name}"}


def schema_with_defs(rng: random.Random) -> dict:
    defs: dict = {}
    schema = random_schema(rng, 0, defs)
    if defs:
        schema = {**schema, "$defs": defs} if "$ref" not in schema else {"$ref": schema["$ref"], "$defs": defs}
    return schema


def test_100_random_schemas_validate_whenever_they_stop(make_engine, run_all, chat_ids, tokenizer):
    rng = random.Random(13)
    engine = make_engine(max_running_requests=64)
    schemas = {f"s{i}": schema_with_defs(rng) for i in range(100)}
    prompt = chat_ids("Reply with JSON.")
    params = SamplingParams(temperature=0.8, max_new_tokens=48, seed=None)
    stopped = 0
    for batch in range(0, 100, 50):
        for rid in list(schemas)[batch : batch + 50]:
            engine.add_request(ReqInput(rid=rid, input_ids=prompt, sampling=params,
                                        grammar=GrammarSpec("json_schema", json.dumps(schemas[rid]))))
        results = run_all(engine)
        for rid, res in results.items():
            assert res.finish.type in (FinishType.STOP, FinishType.LENGTH), (rid, res.finish, schemas[rid])
            if res.finish.type == FinishType.STOP:
                stopped += 1
                text = tokenizer.decode(res.output_ids)
                assert text, (rid, res.output_ids, res.finish, schemas[rid])
                jsonschema.validate(json.loads(text), schemas[rid])
    assert stopped >= 60  # most finish within 48 tokens; the rest run to the length cap
    assert engine.reqs == {} and engine.req_pool.used == 0


def test_constrained_requests_resume_after_retraction_with_the_same_output(make_engine, run_all, chat_ids, tokenizer):
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "integer"},
                                                         "minItems": 3, "maxItems": 3}},
              "required": ["items"], "additionalProperties": False}
    prompts = {f"r{i}": chat_ids(f"List three numbers from {w}.") for i, w in enumerate(["ten", "twenty", "thirty"])}

    def reqs():
        return [ReqInput(rid=rid, input_ids=ids, sampling=SamplingParams(temperature=0.0, max_new_tokens=40),
                         grammar=GrammarSpec("json_schema", json.dumps(schema))) for rid, ids in prompts.items()]

    roomy = make_engine()
    for r in reqs():
        roomy.add_request(r)
    want = {rid: res.output_ids for rid, res in run_all(roomy).items()}
    tiny = make_engine(max_total_tokens=sum(len(p) for p in prompts.values()) + 24)
    for r in reqs():
        tiny.add_request(r)
    got = run_all(tiny)
    assert tiny.policy.num_retracted > 0
    assert {rid: res.output_ids for rid, res in got.items()} == want
    for res in got.values():
        assert res.finish.type == FinishType.STOP
        jsonschema.validate(json.loads(tokenizer.decode(res.output_ids)), schema)
