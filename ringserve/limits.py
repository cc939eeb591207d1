"""Size and nesting limits for the JSON and grammars a request carries as data.

Some request fields hold a document of their own rather than protocol values: a JSON
schema (``response_format``, ``structured_outputs.json``, ``/generate``'s ``json_schema``,
gRPC ``Constraint.json_schema``, the schema a forced tool call builds from ``tools``), the
``tools`` list, ``chat_template_kwargs``, a tool call's ``arguments`` in the history, and
the grammars (``regex``, ``ebnf``/``grammar``, ``choice`` lists). Every one follows one
rule, checked by the first service that reads the field and again where the tokenizer's
gRPC API takes it (direct clients skip the gateway):

- at most ``MAX_JSON_BYTES`` (256 KiB) of UTF-8, as the JSON text the gateway sends on;
- JSON at most ``MAX_JSON_DEPTH`` (32) levels of objects and arrays (``{}`` is level 1,
  ``{"a": []}`` level 2; scalars add none).

Why: the consumers walk these documents recursively (jsonschema's meta-schema check,
transformers' template-data conversion, Jinja, xgrammar's keyword scan), and Python's
recursion limit turned ~600 levels into a RecursionError, a 500 and a 3,000-line
traceback per request. The checks here are iterative and never parse more than the size
limit, so an over-limit document costs a bounded scan, not a parse.

Every check raises ``LimitExceeded``; each service turns it into its own error (the
gateway's 400 ``invalid_request_error``, the tokenizer's INVALID_ARGUMENT with ``param``
metadata, the scheduler's FINISH_ABORT).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from itertools import accumulate

from ringserve.v1 import common_pb2

MAX_JSON_BYTES = 256 * 1024
MAX_JSON_DEPTH = 32

# A JSON string token (RFC 8259 section 7): its brackets are text, not structure.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class LimitExceeded(ValueError):
    """A document in a request is over a limit.

    Attributes:
        message: says which field (``name``) and which limit.
        param: the request parameter to name in the error (OpenAI's ``param``).
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def _too_large(name: str, param: str | None) -> LimitExceeded:
    return LimitExceeded(f"{name}: larger than {MAX_JSON_BYTES} bytes (256 KiB), the limit for JSON and grammars "
                         "inside a request", param or name)


def _too_deep(name: str, param: str | None) -> LimitExceeded:
    return LimitExceeded(f"{name}: nests deeper than {MAX_JSON_DEPTH} levels of objects and arrays, the limit for "
                         "JSON inside a request", param or name)


def _utf8_size(text: str) -> int:
    if len(text) > MAX_JSON_BYTES:
        return len(text)  # over whatever the encoding: no need to encode it
    return len(text.encode("utf-8", "surrogatepass"))


def text_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON text, without parsing it.

    Brackets inside string tokens do not count. For malformed text the result is at
    least the depth any JSON parser reaches before it reports the error, so a text
    that passes cannot make a parser recurse deeper. Cost: a few regular-expression
    passes over the text.
    """
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub('""', text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def value_depth(value: object, stop_after: int = MAX_JSON_DEPTH) -> int:
    """The nesting of dicts and lists (tuples too) in a decoded JSON value, iteratively.

    Stops at ``stop_after + 1``: a deeper value reports that, not its full depth.
    """
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children: Iterable[object]
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        depth += 1
        if depth > stop_after:
            return depth
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children)
    return deepest


def check_json_text(text: str, name: str, param: str | None = None) -> None:
    """Check JSON text from a request (a schema, tools, template kwargs, call arguments).

    Args:
        text: the JSON text as received.
        name: the field, as the message names it (``messages[0].tool_calls[0].function.arguments``).
        param: the request parameter for the error (default ``name``).

    Raises:
        LimitExceeded: over MAX_JSON_BYTES, or nested deeper than MAX_JSON_DEPTH.
    """
    if _utf8_size(text) > MAX_JSON_BYTES:
        raise _too_large(name, param)
    if text_depth(text) > MAX_JSON_DEPTH:
        raise _too_deep(name, param)


def dump_json(value: object, name: str, param: str | None = None) -> str:
    """A decoded JSON value from a request as the JSON text to send on, once it is checked.

    The depth is checked before serializing (``json.dumps`` recurses too), the size on the
    text itself, so the gateway's verdict and the tokenizer's (``check_json_text`` on the
    same text) agree. Stdlib ``json``: client JSON may hold integers beyond 64 bits.

    Raises:
        LimitExceeded: as ``check_json_text``.
    """
    if value_depth(value) > MAX_JSON_DEPTH:
        raise _too_deep(name, param)
    text = json.dumps(value)
    if len(text) > MAX_JSON_BYTES:  # ASCII: json.dumps escapes everything else
        raise _too_large(name, param)
    return text


def check_grammar(kind: str, text: str, name: str, param: str | None = None) -> None:
    """Check a constraint's text: ``kind`` json_schema as JSON, regex/ebnf by size.

    Raises:
        LimitExceeded: as ``check_json_text``; a grammar over MAX_JSON_BYTES.
    """
    if kind == "json_schema":
        check_json_text(text, name, param)
    elif _utf8_size(text) > MAX_JSON_BYTES:
        raise _too_large(name, param)


def check_constraint(c: common_pb2.Constraint, default_param: str = "response_format") -> None:
    """Check a ``Constraint`` of any kind; the message and ``param`` use ``c.param``.

    Raises:
        LimitExceeded: see ``check_grammar``; a choice list whose strings total more
            than MAX_JSON_BYTES.
    """
    kind = c.WhichOneof("kind")
    param = c.param or default_param
    if kind == "choice":
        if c.choice.ByteSize() > MAX_JSON_BYTES:
            raise _too_large(param, param)
    elif kind in ("json_schema", "regex", "ebnf"):
        check_grammar(kind, getattr(c, kind), param)


# A LoRA adapter's name (what requests pass as ``model``) and its path: protocol strings the
# scheduler keeps and quotes in its refusals, so they are bounded like the gRPC details
# that carry them (gRPC drops a status whose details, percent-encoded: up to 12 bytes a
# character, pass 16 KiB, and the call with it).
MAX_LORA_NAME_CHARS = 256
MAX_LORA_PATH_CHARS = 1024


def check_lora_fields(name: str, path: str = "") -> None:
    """Refuse a LoRA adapter name over ``MAX_LORA_NAME_CHARS`` or a path over
    ``MAX_LORA_PATH_CHARS`` characters.

    Raises:
        LimitExceeded: naming ``lora_name`` or ``lora_path`` (the param).
    """
    if len(name) > MAX_LORA_NAME_CHARS:
        raise LimitExceeded(f"lora_name: longer than {MAX_LORA_NAME_CHARS} characters ({len(name)})", "lora_name")
    if len(path) > MAX_LORA_PATH_CHARS:
        raise LimitExceeded(f"lora_path: longer than {MAX_LORA_PATH_CHARS} characters ({len(path)})", "lora_path")
