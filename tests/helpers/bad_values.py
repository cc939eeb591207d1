"""Bad input aimed at every field of an API, the fields taken from its own schema.

``json_fields`` lists every field of a request body in the gateway's OpenAPI schema (nested
objects, array items and each branch of an ``anyOf`` included) and ``proto_fields`` every
scalar field of a protobuf request message, from its descriptor: no hand list of fields, so
a field added later is covered. ``set_json`` / ``set_proto`` put a value at one of them in a
valid base request, building whatever lies on the way from the schema (minimal valid
objects), so the value is judged where it stands rather than next to a missing parent.

The values are the shapes that broke servers here before, not random noise: nesting past
the limits and past Python's recursion limit, strings past the 256 KiB limit, JSON text
nested 10,000 deep, wrong JSON types, numbers outside every integer and float range, keys
no model has, empty and very long lists.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

DEPTHS = (33, 600, 5000)  # past the limit; past Python's recursion limit in a parser; past any parser's
HUGE = 300 * 1024
NUMBERS = (-1, 0, 2**31 - 1, 2**31, -(2**31) - 1, 2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308, 0.5, 1e-320)


def nested(depth: int, kind: str = "object") -> Any:
    value: Any = {} if kind == "object" else []
    for _ in range(depth - 1):
        value = {"a": value} if kind == "object" else [value]
    return value


# One bad JSON value, drawn as a small description (shape, argument) and built by
# ``json_value``: hypothesis prints what it draws, and cannot print 5,000 levels.
json_shapes = st.one_of(
    st.tuples(st.just("deep object"), st.sampled_from(DEPTHS)),
    st.tuples(st.just("deep array"), st.sampled_from(DEPTHS)),
    st.tuples(st.just("huge string"), st.sampled_from("x[")),
    st.tuples(st.just("deep JSON text"), st.just(10_000)),
    st.tuples(st.just("wrong type"), st.sampled_from(["s", 1, 1.5, True, [], {}, None, [None], {"a": None}])),
    st.tuples(st.just("number"), st.sampled_from(NUMBERS)),
    st.tuples(st.just("unknown key"), st.just("x_unknown_key")),
    st.tuples(st.just("empty"), st.sampled_from(["", [], {}])),
    st.tuples(st.just("many"), st.sampled_from(["strings", "ids", "keys"])),
)


@dataclass(frozen=True)
class Raw:
    """JSON text to splice into a body as it is: a value too deep for any encoder to write."""

    text: str


def deep_text(depth: int, kind: str = "object") -> str:
    """``nested(depth, kind)`` as JSON text."""
    if kind == "object":
        return '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1)
    return "[" * depth + "]" * depth


def json_value(shape: tuple[str, Any]) -> Any:
    """The value a ``json_shapes`` description stands for (deep ones as ``Raw`` text)."""
    kind, arg = shape
    if kind in ("deep object", "deep array"):
        return Raw(deep_text(arg, kind.split()[1]))
    if kind == "huge string":
        return arg * HUGE
    if kind == "deep JSON text":
        return "[" * arg + "]" * arg
    if kind == "unknown key":
        return {arg: 1}
    if kind == "many":
        return {"strings": ["a"] * 10_000, "ids": [0] * 10_000, "keys": {f"k{i}": i for i in range(5000)}}[arg]
    return arg


@contextmanager
def no_errors_logged(stack) -> Iterator[None]:
    """Fails if the ring's log grows by a traceback or an ERROR line meanwhile (bad input is
    the client's error: it is answered, not logged as the server's)."""
    start = len(stack.log())
    yield
    added = stack.log()[start:]
    assert "Traceback" not in added and " ERROR " not in added, added[-3000:]


# --- JSON bodies from an OpenAPI schema ----------------------------------------------------


@dataclass(frozen=True)
class Step:
    key: str | int  # a property name, or 0 for an array's first item
    schema: dict  # the resolved schema of the value at this step


class OpenApi:
    def __init__(self, doc: dict) -> None:
        self.doc = doc

    def resolve(self, schema: dict) -> dict:
        while "$ref" in schema:
            name = schema["$ref"].rsplit("/", 1)[-1]
            schema = self.doc["components"]["schemas"][name]
        return schema

    def body_schema(self, path: str) -> dict:
        op = self.doc["paths"][path]["post"]
        return self.resolve(op["requestBody"]["content"]["application/json"]["schema"])

    def branches(self, schema: dict) -> list[dict]:
        """The non-null alternatives of a schema (itself when it is no ``anyOf``)."""
        schema = self.resolve(schema)
        out = [self.resolve(s) for s in schema.get("anyOf", [schema])]
        return [s for s in out if s.get("type") != "null"]

    def minimal(self, schema: dict) -> Any:
        """A small value valid by ``schema``: enum's last member (the richest variant), required keys only."""
        schema = self.branches(schema)[0] if self.branches(schema) else {}
        if "enum" in schema:
            return schema["enum"][-1]
        if "const" in schema:
            return schema["const"]
        kind = schema.get("type")
        if kind == "object":
            props = schema.get("properties", {})
            return {k: self.minimal(props[k]) for k in schema.get("required", ()) if k in props}
        if kind == "array":
            return [self.minimal(schema["items"]) for _ in range(schema.get("minItems", 0))]
        if kind == "string":
            return "a" * max(1, schema.get("minLength", 1))
        if kind in ("integer", "number"):
            return 1
        if kind == "boolean":
            return False
        return None

    def fields(self, schema: dict, trail: tuple[Step, ...] = (), depth: int = 6) -> Iterator[tuple[Step, ...]]:
        """Every field path below ``schema``: each property, array item and anyOf branch."""
        if depth == 0:
            return
        for branch in self.branches(schema):
            if branch.get("type") == "object":
                for key, sub in branch.get("properties", {}).items():
                    steps = (*trail, Step(key, branch))
                    yield steps
                    yield from self.fields(sub, steps, depth - 1)
            elif branch.get("type") == "array":
                steps = (*trail, Step(0, branch))
                yield steps
                yield from self.fields(branch["items"], steps, depth - 1)


def json_fields(api: OpenApi, path: str) -> list[tuple[Step, ...]]:
    """Every field of ``path``'s request body, once each (an anyOf branch adds paths, not duplicates)."""
    seen: dict[tuple, tuple[Step, ...]] = {}
    for steps in api.fields(api.body_schema(path)):
        seen.setdefault(tuple(s.key for s in steps), steps)
    return list(seen.values())


def field_name(steps: tuple[Step, ...]) -> str:
    return "".join(f"[{s.key}]" if isinstance(s.key, int) else f".{s.key}" for s in steps).lstrip(".")


def dump_body(body: dict, raw: Raw | None = None, marker: str = "\x00raw\x00") -> str:
    """``body`` as JSON text, with ``raw`` spliced in where the string ``marker`` stands."""
    text = json.dumps(body)
    return text if raw is None else text.replace(json.dumps(marker), raw.text, 1)


def set_json(api: OpenApi, body: dict, steps: tuple[Step, ...], value: Any) -> dict:
    """``body`` with ``value`` at ``steps``; containers missing on the way are minimal valid ones.

    Each ``Step.schema`` is the container holding that step's key; its member schema gives
    the minimal child that is made when the body has none of the right kind.
    """
    holder: Any = body
    for i, step in enumerate(steps):
        last = i == len(steps) - 1
        container = step.schema
        if isinstance(step.key, int):
            if not isinstance(holder, list):
                raise TypeError("array step over a non-list")
            if last:
                holder[:1] = [value]
                return body
            if not holder:
                holder.append(api.minimal(container["items"]))
            child_kind = type(holder[0])
        else:
            if last:
                holder[step.key] = value
                return body
            child_kind = type(holder.get(step.key))
        want = steps[i + 1].schema.get("type")
        fits = {"object": dict, "array": list}[want]
        if child_kind is not fits:
            child = api.minimal(steps[i + 1].schema) if want == "object" else []
            if isinstance(step.key, int):
                holder[0] = child
            else:
                holder[step.key] = child
        holder = holder[step.key]
    return body


# --- protobuf requests from descriptors ----------------------------------------------------


def proto_fields(desc: Descriptor, trail: tuple[FieldDescriptor, ...] = (), depth: int = 5
                 ) -> Iterator[tuple[FieldDescriptor, ...]]:
    """Every field path below message type ``desc`` (messages recursed into, maps as leaves)."""
    if depth == 0:
        return
    for f in desc.fields:
        steps = (*trail, f)
        yield steps
        if f.type == FieldDescriptor.TYPE_MESSAGE and not is_map(f):
            yield from proto_fields(f.message_type, steps, depth - 1)


def is_map(f: FieldDescriptor) -> bool:
    return f.message_type is not None and f.message_type.GetOptions().map_entry


# Each also past SmolLM2's context (8,192 tokens) as a prompt, so that no example pays for a
# long prefill: "[" * 10,000 is 10,000 tokens, and the 600 objects carry 8,200 " x" tokens.
STRINGS = {"huge": "x" * HUGE, "deep JSON text": "[" * 10_000 + "]" * 10_000,
           "deep object text": '{"pad": "' + " x" * 8200 + '", "a": ' + '{"a": ' * 599 + "1" + "}" * 600}


def proto_values(f: FieldDescriptor) -> st.SearchStrategy:
    """Bad values for field ``f``, by the type it declares (a map: (key, value) pairs)."""
    t = FieldDescriptor
    if is_map(f):
        key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        return st.tuples(proto_values(key), proto_values(value))
    if f.type == t.TYPE_MESSAGE:
        return st.none()  # the message itself: set, empty
    if f.type == t.TYPE_STRING:
        return st.sampled_from([*STRINGS, "", "\x00\uffff\U0001f600"])  # names of STRINGS, printable
    if f.type == t.TYPE_BYTES:
        return st.sampled_from([b"", b"\xff" * 16])
    if f.type == t.TYPE_BOOL:
        return st.booleans()
    if f.type in (t.TYPE_FLOAT, t.TYPE_DOUBLE):
        return st.sampled_from([math.nan, math.inf, -math.inf, 3.4e38, -3.4e38, -0.0, 1e-45])
    if f.type == t.TYPE_ENUM:
        return st.sampled_from([v.number for v in f.enum_type.values] + [99, -1])
    bits = 64 if f.type in (t.TYPE_INT64, t.TYPE_UINT64, t.TYPE_SINT64, t.TYPE_FIXED64, t.TYPE_SFIXED64) else 32
    unsigned = f.type in (t.TYPE_UINT32, t.TYPE_UINT64, t.TYPE_FIXED32, t.TYPE_FIXED64)
    low, high = (0, 2**bits - 1) if unsigned else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return st.sampled_from([low, high, 0, 1, -1 if not unsigned else high - 1])


def set_proto(msg: Message, steps: tuple[FieldDescriptor, ...], value: Any, many: bool) -> Message:
    """``msg`` with ``value`` at ``steps`` (a repeated field gets it once, or 10,000 times with
    ``many``, 3 for a long string; a map one entry, plus ids 0..9,999 with ``many``); messages on the way are
    created, their other fields left as they are."""
    holder = msg
    for f in steps[:-1]:
        if f.is_repeated:
            field = getattr(holder, f.name)
            holder = field[0] if len(field) else field.add()
        else:
            holder = getattr(holder, f.name)
            holder.SetInParent()
    f = steps[-1]
    if f.type == FieldDescriptor.TYPE_STRING:
        value = STRINGS.get(value, value)
    if is_map(f):
        key, item = value
        entries = getattr(holder, f.name)
        entries[key] = item
        if many and isinstance(key, int):
            for i in range(10_000):
                entries[i] = item
        return msg
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        field = getattr(holder, f.name)
        if f.is_repeated:
            for _ in range(10_000 if many else 1):
                field.add()
        else:
            field.SetInParent()
    elif f.is_repeated:
        count = 1 if not many else 10_000 if not isinstance(value, str) or len(value) <= 100 else 3
        getattr(holder, f.name).extend([value] * count)
    else:
        setattr(holder, f.name, value)
    return msg

