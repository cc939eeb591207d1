"""Proofs that the branches of a JSON Schema ``oneOf`` are mutually exclusive.

``oneOf`` means "exactly one branch matches". When no instance can match two branches, it
means the same as ``anyOf`` ("at least one"), which the grammar engines enforce exactly;
this module decides that, and only by proof: when it cannot show two branches disjoint it
says how they may overlap, and the caller refuses the schema (weakening ``oneOf`` into
``anyOf`` without a proof would let an output match two branches).

A proof works on *facts*: necessary conditions every instance of a schema meets (an
over-approximation of the schema, so a fact never claims more than JSON Schema 2020-12
says). Two schemas are disjoint when, for every JSON kind both admit, one of these holds:

- both admit only finitely many values of that kind (``const``, ``enum``) and the two sets
  share none (JSON equality: 1 equals 1.0, true is no number);
- objects: one schema requires a key whose value the other constrains (``properties``)
  with a schema disjoint from the first's (a discriminator: distinct ``const``/``enum``
  values, or disjoint types), or one requires a key the other forbids (it closes its
  objects with ``additionalProperties: false`` and no ``patternProperties``, and does not
  list the key).

The kinds are JSON Schema's types with ``number`` split into ``integer`` (any number with a
zero fractional part, 1.0 included, as 2020-12 counts integers) and ``fraction``: an
integer is a number, so ``integer`` and ``number`` overlap. A branch that is itself an
``anyOf``/``oneOf`` is disjoint from another schema when each of its alternatives is.
Local ``$ref``s (``#`` and ``#/json/pointer``) are followed; any other ``$ref``, or any
``$ref`` in a document with a nested ``$id`` (which changes what a pointer means below
it), ends the proof unproven. A ``$ref``'s sibling keywords add no facts (JSON Schema
drafts disagree on whether they apply; leaving them out is sound under both readings).
"""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

KINDS = ("null", "boolean", "integer", "fraction", "string", "array", "object")
ALL_KINDS = frozenset(KINDS)
_TYPE_KINDS = {"null": {"null"}, "boolean": {"boolean"}, "integer": {"integer"}, "number": {"integer", "fraction"},
               "string": {"string"}, "array": {"array"}, "object": {"object"}}
_KIND_NAMES = {"null": "null", "boolean": "booleans", "integer": "integers", "fraction": "non-integer numbers",
               "string": "strings", "array": "arrays", "object": "objects"}
MAX_DEPTH = 16  # nested discriminators followed; deeper is left unproven
MAX_STEPS = 20_000  # pair checks per schema document; past it the proof gives up


class Unproven(Exception):
    """The proof cannot go on (an unresolvable ``$ref``, a document too large to check)."""


def kind_of(value: Any) -> str:
    """The JSON kind of a decoded JSON value (``KINDS``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "integer" if value.is_integer() else "fraction"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _canonical(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)  # exact: 1.0 and 1 are one JSON number
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    return value


def value_key(value: Any) -> str:
    """A string equal for two decoded JSON values exactly when JSON Schema calls them equal."""
    return json.dumps(_canonical(value), sort_keys=True)


@dataclass
class Facts:
    """What every instance of a schema satisfies. ``values``: the finite set of values it may
    take (by ``value_key``), or None; ``required``: keys an object instance has; ``props``:
    per key, schemas its value satisfies when present; ``closed``: key sets an object
    instance's keys lie within."""

    kinds: frozenset[str] = ALL_KINDS
    values: dict[str, Any] | None = None
    required: set[str] = field(default_factory=set)
    props: dict[str, list[Any]] = field(default_factory=dict)
    closed: list[frozenset[str]] = field(default_factory=list)

    def narrow(self, kinds: frozenset[str], values: dict[str, Any] | None) -> None:
        self.kinds &= kinds
        if values is not None:
            self.values = values if self.values is None else {k: v for k, v in self.values.items() if k in values}
        if self.values is not None:
            self.values = {k: v for k, v in self.values.items() if kind_of(v) in self.kinds}
            self.kinds &= {kind_of(v) for v in self.values.values()}

    def values_of(self, kind: str) -> set[str] | None:
        return None if self.values is None else {k for k, v in self.values.items() if kind_of(v) == kind}


def _has_nested_id(document: Any) -> bool:
    todo = [v for k, v in document.items() if k not in ("const", "enum", "default", "examples")] \
        if isinstance(document, dict) else []
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
        elif isinstance(node, dict):
            if "$id" in node:
                return True
            todo.extend(v for k, v in node.items() if k not in ("const", "enum", "default", "examples"))
    return False


def resolve_pointer(document: Any, ref: Any) -> tuple[Any, str] | None:
    """The node a local ``$ref`` (``#`` or ``#/json/pointer``, RFC 6901, percent-encoded as
    a URI fragment) names in ``document``, with its JSON Pointer; None when ``ref`` is not
    such a reference or names nothing."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    pointer = urllib.parse.unquote(ref[1:])
    node = document
    for raw in pointer.split("/")[1:]:
        token = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and (token == "0" or token[0] != "0") \
                and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node, pointer


class ExclusiveProver:
    """Decides, for one schema document, whether ``oneOf`` branches are provably exclusive."""

    def __init__(self, document: Any):
        self.document = document
        self.refs_followed = not _has_nested_id(document)
        self._facts: dict[int, Facts] = {}
        self._open: set[int] = set()  # schemas whose facts are being gathered (a $ref cycle)
        self._steps = 0

    def overlap(self, branches: list[Any]) -> tuple[int, int, str] | None:
        """None when no instance can match two of ``branches``; else the first pair (by index)
        not shown disjoint and how they may overlap.

        Raises:
            Unproven: a ``$ref`` that cannot be followed, or the document is too large to check.
        """
        facts = [self.facts(b) for b in branches]
        if all(f.values is not None for f in facts):  # finite sets only: one pass, whatever their number
            owner: dict[str, int] = {}
            for j, f in enumerate(facts):
                for key in f.values or ():
                    if key in owner:
                        return owner[key], j, f"both admit the value {key}"
                    owner[key] = j
            return None
        for i in range(len(branches)):
            for j in range(i + 1, len(branches)):
                why = self._overlap(branches[i], branches[j], 0)
                if why is not None:
                    return i, j, why
        return None

    def _target(self, schema: Any) -> Any:
        """``schema`` with its chain of ``$ref``s followed (bounded; a cycle is unproven)."""
        for _ in range(MAX_DEPTH):
            if not (isinstance(schema, dict) and "$ref" in schema):
                return schema
            found = resolve_pointer(self.document, schema["$ref"]) if self.refs_followed else None
            if found is None:
                why = "(the schema has a nested $id)" if not self.refs_followed else "(only local JSON Pointers are)"
                raise Unproven(f"the $ref {schema['$ref']!r} cannot be followed {why}")
            schema = found[0]
        raise Unproven("its $refs chain deeper than the proof follows")

    def _overlap(self, a: Any, b: Any, depth: int) -> str | None:
        self._steps += 1
        if self._steps > MAX_STEPS:
            raise Unproven(f"the document is too large to check (more than {MAX_STEPS} comparisons)")
        if depth > MAX_DEPTH:
            return "the proof nests too deep"
        a, b = self._target(a), self._target(b)
        why = self._overlap_by_facts(self.facts(a), self.facts(b), depth)
        if why is None:
            return None
        for x, y in ((a, b), (b, a)):  # x is within the union of its alternatives
            for key in ("anyOf", "oneOf"):
                alternatives = x.get(key) if isinstance(x, dict) else None
                if isinstance(alternatives, list) and all(self._overlap(alt, y, depth + 1) is None
                                                          for alt in alternatives):
                    return None
        return why

    def _overlap_by_facts(self, fa: Facts, fb: Facts, depth: int) -> str | None:
        for kind in KINDS:
            if kind not in fa.kinds or kind not in fb.kinds:
                continue
            va, vb = fa.values_of(kind), fb.values_of(kind)
            if va is not None and vb is not None and not va & vb:
                continue
            if kind == "object" and self._objects_apart(fa, fb, depth):
                continue
            return f"both admit {_KIND_NAMES[kind]}" + (" and no required property tells them apart"
                                                        if kind == "object" else "")
        return None

    def _objects_apart(self, fa: Facts, fb: Facts, depth: int) -> bool:
        for x, y in ((fa, fb), (fb, fa)):
            for key in sorted(x.required):
                if any(key not in keys for keys in y.closed):
                    return True  # x's objects have the key, y's may not
                for sx in x.props.get(key, ()):
                    for sy in y.props.get(key, ()):
                        if self._overlap(sx, sy, depth + 1) is None:
                            return True  # a discriminator: the key's value cannot satisfy both
        return False

    def facts(self, schema: Any) -> Facts:
        """The facts of ``schema`` (a schema of the document, ``$ref``s not yet followed).

        Raises:
            Unproven: a ``$ref`` that cannot be followed.
        """
        schema = self._target(schema)
        if schema is False:
            return Facts(kinds=frozenset())
        if not isinstance(schema, dict):
            return Facts()
        key = id(schema)
        if key in self._facts:
            return self._facts[key]
        if key in self._open:
            return Facts()  # a cycle: no facts is a sound answer
        self._open.add(key)
        try:
            out = self._gather(schema)
        finally:
            self._open.discard(key)
        self._facts[key] = out
        return out

    def _gather(self, schema: dict) -> Facts:
        out = Facts()
        types = schema.get("type")
        if isinstance(types, str):
            types = [types]
        if isinstance(types, list):
            out.narrow(frozenset(k for t in types for k in _TYPE_KINDS.get(t, ALL_KINDS)), None)
        if "const" in schema:
            out.narrow(ALL_KINDS, {value_key(schema["const"]): schema["const"]})
        if isinstance(schema.get("enum"), list):
            out.narrow(ALL_KINDS, {value_key(v): v for v in schema["enum"]})
        required = schema.get("required")
        if isinstance(required, list):
            out.required.update(k for k in required if isinstance(k, str))
        props = schema.get("properties")
        if isinstance(props, dict):
            for name, sub in props.items():
                out.props.setdefault(name, []).append(sub)
            if schema.get("additionalProperties") is False and not schema.get("patternProperties"):
                out.closed.append(frozenset(props))
        elif schema.get("additionalProperties") is False and not schema.get("patternProperties"):
            out.closed.append(frozenset())
        all_of = schema.get("allOf")
        for sub in all_of if isinstance(all_of, list) else ():
            f = self.facts(sub)
            out.narrow(f.kinds, f.values)
            out.required |= f.required
            for name, subs in f.props.items():
                out.props.setdefault(name, []).extend(subs)
            out.closed.extend(f.closed)
        for keyword in ("anyOf", "oneOf"):
            alternatives = schema.get(keyword)
            if isinstance(alternatives, list) and alternatives:
                fs = [self.facts(sub) for sub in alternatives]
                values: dict[str, Any] | None = {}
                for f in fs:
                    values = None if values is None or f.values is None else {**values, **f.values}
                out.narrow(frozenset().union(*(f.kinds for f in fs)), values)
                out.required |= set.intersection(*(f.required for f in fs))
        return out
