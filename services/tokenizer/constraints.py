"""Check a request's output constraint and put it in the form the scheduler compiles.

The scheduler's grammar backend is the authority on what compiles (an unknown ``$ref``, a
regex its engine rejects, an unenforceable keyword: FINISH_ABORT / INVALID_ARGUMENT from
there); here go the checks that need no grammar engine, so that most mistakes are a 400
before dispatch: a schema that is not JSON or fails the JSON Schema 2020-12 meta-schema,
an empty regex, grammar or choice list, a constraint over the limits of ``ringserve.limits``.
A choice list becomes a GBNF grammar of string literals and ``json_object`` the schema
``{"type": "object"}``: the scheduler sees only json_schema, regex and ebnf.
"""

from __future__ import annotations

import json

import jsonschema

from ringserve import limits
from ringserve.v1 import common_pb2
from services.tokenizer.errors import invalid, over_limit

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
    return text


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
    out = common_pb2.Constraint(param=param, starts_after=c.starts_after)
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
        out.ebnf = choice_grammar(choices)
    else:
        text = getattr(c, kind)
        if not text:
            raise invalid(f"{param}: the {kind} is empty", param)
        setattr(out, kind, text)
    return out
