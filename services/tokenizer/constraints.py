"""Check a request's output constraint and put it in the form the scheduler compiles.

The scheduler's grammar backend is the authority on what compiles (a ``$ref`` that is not a
local JSON Pointer, a regex its engine rejects, a limit of its parser: FINISH_ABORT /
INVALID_ARGUMENT from there); here go the checks that need no grammar engine, so that most mistakes are a 400
before dispatch: a schema that is not JSON or fails the JSON Schema 2020-12 meta-schema,
an empty regex, grammar or choice list, a constraint over the limits of ``ringserve.limits``, a
choice list longer than ``MAX_CHOICES``, a regex (or schema pattern) that counts further
than ``regex_repeats.MAX_REPEAT``, a schema keyword no engine enforces or a ``oneOf`` not
provably exclusive (``ringserve.schema_rewrite``, which also puts the schema in the form the
scheduler compiles). A choice list becomes a GBNF grammar of string literals and
``json_object`` the schema ``{"type": "object"}``: the scheduler sees only json_schema,
regex and ebnf.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import jsonschema

from ringserve import limits
from ringserve.schema_rewrite import SchemaRefused, rewrite_in_place
from ringserve.v1 import common_pb2
from services.tokenizer.errors import invalid, over_limit
from services.tokenizer.regex_repeats import MAX_REPEAT, max_repeat

# llguidance keeps every alternative of a rule in one Earley row and fails past 2,000 (its
# max_items_in_row): the choice grammar's alternatives stay well inside that.
MAX_CHOICES = 1000
_DATA_KEYWORDS = ("const", "enum", "default", "examples")  # their values are JSON data, not schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
DEFAULT_PARAM = {"json_schema": "response_format", "json_object": "response_format", "regex": "regex",
                 "ebnf": "ebnf", "choice": "choice"}


def _gbnf_literal(text: str) -> str:
    """``text`` as a GBNF string literal (quotes, backslashes and control characters escaped)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ch == "\x7f":
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _check_repeats(regex: str, param: str, where: str = "the regex") -> None:
    count = max_repeat(regex)
    if count > MAX_REPEAT:
        raise invalid(f"{param}: {where} counts to {count} (nested repetitions multiplied); "
                      f"at most {MAX_REPEAT} is supported", param)


def _schema_patterns(schema: dict):
    """Every regex of a schema document (``pattern`` values, ``patternProperties`` keys)."""
    todo: list[object] = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            for key, value in node.items():
                if key == "pattern" and isinstance(value, str):
                    yield value
                elif key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema: names are no keywords
                    if key == "patternProperties":
                        yield from value
                    todo.extend(value.values())
                elif key not in _DATA_KEYWORDS:
                    todo.append(value)


def choice_grammar(choices: list[str]) -> str:
    """GBNF whose only sentences are ``choices``."""
    return "root ::= " + " | ".join(_gbnf_literal(c) for c in choices)


def _check_schema(text: str, param: str) -> str:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise invalid(f"{param}: the JSON schema is not valid JSON: {exc}", param) from None
    if schema is True:
        return "{}"
    if not isinstance(schema, dict):
        raise invalid(f"{param}: a JSON schema must be an object (or true), got {type(schema).__name__}", param)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "(root)"
        raise invalid(f"{param}: not a valid JSON Schema at {where}: {exc.message}", param) from None
    for pattern in _schema_patterns(schema):
        _check_repeats(pattern, param, f"the schema pattern {pattern[:40]!r}")
    try:
        changed = rewrite_in_place(schema)
    except SchemaRefused as exc:
        raise invalid(f"{param}: {exc}", param) from None
    return json.dumps(schema) if changed else text


def resolve_constraint(c: common_pb2.Constraint) -> common_pb2.Constraint:
    """The constraint as the scheduler takes it (json_schema, regex or ebnf, with ``param`` set).

    Raises:
        RequestError: INVALID_ARGUMENT naming the request field (``c.param``).
    """
    kind = c.WhichOneof("kind")
    if kind is None:
        raise invalid("the constraint names no kind (json_schema, json_object, regex, ebnf or choice)",
                      c.param or "response_format")
    param = c.param or DEFAULT_PARAM[kind]
    try:
        limits.check_constraint(c, param)  # before parsing: the parsers and jsonschema recurse
    except limits.LimitExceeded as exc:
        raise over_limit(exc) from None
    out = common_pb2.Constraint(param=param, starts_after=c.starts_after, opens_with=c.opens_with)
    if kind == "json_object":
        out.json_schema = '{"type": "object"}'
    elif kind == "json_schema":
        out.json_schema = _check_schema(c.json_schema, param)
    elif kind == "choice":
        choices = list(c.choice.choices)
        if not choices:
            raise invalid(f"{param}: the choice list is empty", param)
        if any(not s for s in choices):
            raise invalid(f"{param}: a choice is an empty string", param)
        if len(choices) > MAX_CHOICES:
            raise invalid(f"{param}: {len(choices)} choices; at most {MAX_CHOICES} are supported", param)
        out.ebnf = choice_grammar(choices)
    else:
        text = getattr(c, kind)
        if not text:
            raise invalid(f"{param}: the {kind} is empty", param)
        if kind == "regex":
            _check_repeats(text, param)
        setattr(out, kind, text)
    return out


def gate_reasoning(params: common_pb2.ResolvedSamplingParams, prompt: str | None, reasoning_start: str,
                   encode: Callable[[str], list[int]]) -> bool:
    """Whether the rendered ``prompt`` opened a reasoning block: it ends with ``reasoning_start``
    (blanks after it allowed; "" = the prompt never opens one). Puts the constraint's reasoning
    tags into token ids for the scheduler (``encode``: text -> ids, no special tokens added);
    when the prompt opened the reasoning, the output is reasoning from its first token, so
    ``opens_with`` is cleared."""
    tail = prompt[-(len(reasoning_start) + 256) :] if prompt else ""  # a bounded look at the end
    opened = bool(reasoning_start) and tail.rstrip().endswith(reasoning_start)
    c = params.constraint
    if params.HasField("constraint") and c.starts_after:
        c.starts_after_ids[:] = encode(c.starts_after)
        if opened:
            c.opens_with = ""
        c.opens_with_ids[:] = encode(c.opens_with) if c.opens_with else []
    return opened
