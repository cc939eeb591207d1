"""Request fields that constrain the output -> the contract's ``Constraint``.

OpenAI's ``response_format`` (text / json_object / json_schema), vLLM's
``structured_outputs`` (json / json_object / regex / choice / grammar), SGLang's
``json_schema`` / ``regex`` / ``ebnf`` on ``/generate`` (top level or in sampling_params),
and forced tool calls (``tool_choice`` "required" or a named function): a JSON schema of
a non-empty array of ``{"name", "arguments"}`` objects built from the tools' parameters.
At most one constraint per request; each carries the field it came from, which every
error about it names. Whether a constraint compiles is the scheduler's grammar engine's
call; the tokenizer checks the rest (see services/tokenizer/constraints.py).

``strict: true`` (``response_format.json_schema.strict``, a forced tool's
``function.strict``) closes every object schema that omits ``additionalProperties``, as
OpenAI's strict mode means it (there it must be written ``false``): JSON Schema's default
(any other key allowed) lets a small model add keys until max_tokens. Without strict the
schema means what JSON Schema says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TypeVar

from ringserve import limits
from ringserve.v1 import common_pb2

from .errors import invalid
from .protocol import ChatCompletionRequest, GenerateRequest, NamedToolChoice, SamplingFields, Tool

_Json = TypeVar("_Json")

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_DATA_KEYWORDS = ("const", "enum", "default", "examples")  # JSON data, not schemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema


def closed_objects(schema: _Json) -> _Json:
    """``schema`` (a JSON value, changed in place) with ``"additionalProperties": false`` on
    every object schema (``type`` object, or ``properties`` given) that omits it: strict mode.
    The branches of an ``allOf`` stay as written (closing each would forbid the keys of the
    others). Iterative: no recursion however deep the document."""
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if "additionalProperties" not in node and ("properties" in node or kind == "object"
                                                   or isinstance(kind, list) and "object" in kind):
            node["additionalProperties"] = False
        for key, value in node.items():
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                todo.extend(value.values())
            elif key not in _DATA_KEYWORDS and key != "allOf":
                todo.append(value)
    return schema


def _schema_text(schema: object, name: str, param: str, strict: bool = False) -> str:
    if isinstance(schema, str):
        return schema  # vLLM accepts the schema as JSON text; the tokenizer parses it (checked in _one)
    text = limits.dump_json(schema, name, param)  # checked before anything walks it
    return json.dumps(closed_objects(json.loads(text))) if strict else text


def _one(found: list[tuple[str, common_pb2.Constraint]]) -> common_pb2.Constraint | None:
    if len(found) > 1:
        names = " and ".join(p for p, _ in found)
        raise invalid(f"give at most one output constraint, got {names}", found[1][0])
    if not found:
        return None
    limits.check_constraint(found[0][1])
    return found[0][1]


def request_constraint(req: SamplingFields) -> common_pb2.Constraint | None:
    """The constraint of a chat or completions request (response_format or structured_outputs).

    Raises:
        GatewayError(400): a json_schema format without its schema, or two constraints.
        LimitExceeded: a schema or grammar over the limits of ``ringserve.limits``.
    """
    found: list[tuple[str, common_pb2.Constraint]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", common_pb2.Constraint(json_object=True, param="response_format")))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise invalid("response_format of type json_schema needs a json_schema object", "response_format")
        if rf.json_schema.schema_ is None:
            raise invalid("response_format.json_schema.schema is required", "response_format")
        text = _schema_text(rf.json_schema.schema_, "response_format.json_schema.schema", "response_format",
                            rf.json_schema.strict is True)
        found.append(("response_format", common_pb2.Constraint(json_schema=text, param="response_format")))
    so = req.structured_outputs
    if so is not None:
        given = {k: v for k, v in so.model_dump(by_alias=True, exclude_none=True).items()}
        if so.json_object is False:
            given.pop("json_object")
        if len(given) != 1:
            raise invalid("structured_outputs needs exactly one of json, json_object, regex, choice, grammar",
                          "structured_outputs")
        (key, value), = given.items()
        param = f"structured_outputs.{key}"
        c = common_pb2.Constraint(param=param)
        if key == "json":
            c.json_schema = _schema_text(value, param, param)
        elif key == "json_object":
            c.json_object = True
        elif key == "regex":
            c.regex = value
        elif key == "choice":
            c.choice.choices.extend(value)
        else:
            c.ebnf = value
        found.append((param, c))
    return _one(found)


def native_constraint(req: GenerateRequest) -> common_pb2.Constraint | None:
    """SGLang's json_schema / regex / ebnf, at the top level of /generate or in its sampling_params.

    Raises:
        GatewayError(400): two constraints.
        LimitExceeded: a schema or grammar over the limits of ``ringserve.limits``.
    """
    found = []
    for where, holder in (("", req), ("sampling_params.", req.sampling_params)):
        for key in ("json_schema", "regex", "ebnf"):
            value = getattr(holder, key)
            if value is not None:
                c = common_pb2.Constraint(param=where + key)
                setattr(c, key, value)
                found.append((where + key, c))
    return _one(found)


def tool_calls_schema(tools: Sequence[Tool], parallel: bool) -> dict:
    """JSON schema of the forced tool-call format: ``[{"name": ..., "arguments": {...}}, ...]``."""
    items = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": _arguments(t)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _arguments(tool: Tool) -> dict:
    """The schema of a tool's arguments (closed under ``function.strict``)."""
    params = tool.function.parameters
    if not params:
        return NO_PARAMETERS
    if not tool.function.strict:
        return params
    return closed_objects(json.loads(limits.dump_json(params, "tools[].function.parameters", "tools")))


def forced_tools(req: ChatCompletionRequest) -> list[Tool] | None:
    """The tools a call must be made from (tool_choice "required" or named), else None.

    Raises:
        GatewayError(400): a tool name outside OpenAI's rule or given twice, tool_choice
            without tools, "required" with an empty list, a named function not in tools, or
            a forced call together with an output constraint.
    """
    names = [t.function.name for t in req.tools or ()]
    bad = next((n for n in names if not TOOL_NAME.fullmatch(n)), None)
    if bad is not None:
        raise invalid(f"tools: function name {bad!r} must be 1-64 letters, digits, '_' or '-'", "tools")
    if len(set(names)) != len(names):
        raise invalid("tools: function names must be unique", "tools")
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto"):
        if choice is not None and req.tools is None:
            raise invalid("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    tools = req.tools or []
    if choice == "required":
        if not tools:
            raise invalid('tool_choice "required" needs at least one tool in tools', "tool_choice")
        chosen = list(tools)
    else:
        assert isinstance(choice, NamedToolChoice)  # the three literals are handled above
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise invalid(f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                          "tool_choice")
    if req.response_format is not None and req.response_format.type != "text" or req.structured_outputs is not None:
        raise invalid("a forced tool call (tool_choice) cannot be combined with response_format or "
                      "structured_outputs", "tool_choice")
    return chosen


def forced_tool_constraint(req: ChatCompletionRequest, tools: list[Tool]) -> common_pb2.Constraint:
    """The forced call's constraint; its schema follows the limits of any other schema.

    Raises:
        LimitExceeded: the schema built from the tools is over the limits (it nests each
            tool's parameters two levels deeper than ``tools`` does).
    """
    parallel = req.parallel_tool_calls is not False and req.tool_choice == "required"
    schema = limits.dump_json(tool_calls_schema(tools, parallel), "the tool-call schema built from tools",
                              "tool_choice")
    return common_pb2.Constraint(json_schema=schema, param="tool_choice")
