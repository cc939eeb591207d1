"""A JSON schema in the form the grammar engines compile, or a refusal that names its keyword.

One function, ``rewrite_schema``, run twice on every ``json_schema`` constraint: by the
tokenizer where it validates a request (a refusal is a 400 before any output) and by the
scheduler's grammar backends before they compile (so a constraint that reaches the
scheduler by any path means the same). The rewrite is exact, never a weakening:

- ``oneOf`` whose branches are provably mutually exclusive (``ringserve.schema_exclusive``)
  becomes ``anyOf``: when at most one branch can match, "exactly one" and "at least one"
  accept the same instances. Any other ``oneOf`` is refused.
- ``format`` values outside ``ENFORCED_FORMATS`` are dropped: JSON Schema 2020-12 makes
  ``format`` an annotation by default, and an unknown format (``url``, ``int32``, ...)
  asserts nothing. The enforced ones stay enforced (llguidance and xgrammar both build
  them into the grammar).
- ``uniqueItems: false`` (the default, asserting nothing) is dropped.
- The keywords no engine enforces (``REFUSED_KEYWORDS``) are refused; so is a local
  ``$ref`` that names nothing.

Every refusal is a ``SchemaRefused`` naming the keyword and the JSON Pointer (RFC 6901) of
the schema that holds it. The walk follows the schema positions the engines compile: the
keywords that hold subschemas, from the root, and the targets of local ``$ref``s (an
unreferenced ``$defs`` entry is not compiled, so it is not checked either), each once.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from ringserve.schema_exclusive import ExclusiveProver, Unproven, resolve_pointer

# The formats llguidance (the default engine) enforces; it refuses any other. xgrammar
# enforces these too.
ENFORCED_FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid",
                              "uri"})
# JSON Schema keywords the engines cannot enforce (llguidance names them "unimplemented";
# xgrammar would ignore or approximate them): refused rather than weakened.
REFUSED_KEYWORDS = ("not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
                    "propertyNames", "dependencies", "dependentRequired", "dependentSchemas",
                    "unevaluatedProperties", "unevaluatedItems", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
                    "$recursiveAnchor")
_LIST_KEYWORDS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")  # items: an array of schemas before 2020-12
_SCHEMA_KEYWORDS = ("items", "additionalItems", "additionalProperties")
_MAP_KEYWORDS = ("properties", "patternProperties")  # name -> schema ($defs are reached through $ref)


class SchemaRefused(ValueError):
    """A schema keyword that cannot be compiled exactly; the message names it and its JSON Pointer."""

    def __init__(self, keyword: str, pointer: str, reason: str):
        self.keyword, self.pointer = keyword, pointer
        super().__init__(f"{keyword} at {pointer or '(root)'} {reason}")


def pointer_token(name: str) -> str:
    """``name`` as one reference token of a JSON Pointer (RFC 6901: ``~`` as ``~0``, ``/`` as ``~1``)."""
    return name.replace("~", "~0").replace("/", "~1")


def rewrite_schema(text: str) -> str:
    """The JSON schema ``text`` as the grammar engines take it: ``text`` itself when nothing
    changes, else the rewritten schema as JSON (see the module docstring). Text that is not
    JSON comes back as it is (the engine says why it cannot compile it).

    Raises:
        SchemaRefused: a ``oneOf`` not provably exclusive, a keyword in ``REFUSED_KEYWORDS``
            (``uniqueItems: false`` aside), a local ``$ref`` naming nothing.
    """
    try:
        schema = json.loads(text)
    except ValueError:
        return text
    return json.dumps(schema) if rewrite_in_place(schema) else text


def rewrite_in_place(schema: Any) -> bool:
    """``rewrite_schema`` on a decoded schema, changed in place; True when anything changed.

    Raises:
        SchemaRefused: as ``rewrite_schema``.
    """
    prover = ExclusiveProver(schema)
    renamed: dict[int, dict] = {}  # the schemas whose oneOf becomes anyOf
    refs: list[dict] = []
    changed = False
    seen: set[int] = set()
    todo: list[tuple[Any, str]] = [(schema, "")]
    while todo:
        node, pointer = todo.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        if node.get("uniqueItems") is False:
            del node["uniqueItems"]
            changed = True
        refused = next((k for k in REFUSED_KEYWORDS if k in node), None)
        if refused is not None:
            raise SchemaRefused(refused, pointer, "is not supported: the grammar engine cannot enforce it")
        if isinstance(node.get("format"), str) and node["format"] not in ENFORCED_FORMATS:
            del node["format"]  # an annotation (2020-12's default for formats)
            changed = True
        if isinstance(node.get("oneOf"), list):
            _prove_exclusive(prover, node, pointer)
            renamed[id(node)] = node
        children: list[tuple[Any, str]] = []
        for key, value in node.items():
            at = f"{pointer}/{pointer_token(key)}"
            if key in _MAP_KEYWORDS and isinstance(value, dict):
                children.extend((sub, f"{at}/{pointer_token(name)}") for name, sub in value.items())
            elif key in _LIST_KEYWORDS and isinstance(value, list):
                children.extend((sub, f"{at}/{i}") for i, sub in enumerate(value))
            elif key in _SCHEMA_KEYWORDS:
                children.append((value, at))
            elif key == "$ref" and prover.refs_followed:
                refs.append(node)
                found = resolve_pointer(schema, value)
                if found is not None:
                    children.append(found)
                elif isinstance(value, str) and (value == "#" or value.startswith("#/")):
                    raise SchemaRefused("$ref", pointer, "names nothing in the schema: Pointer "
                                                         f"{urllib.parse.unquote(value[1:])!r} does not exist")
        todo.extend(reversed(children))  # depth first, in document order
    if renamed:
        for node in refs:  # before renaming: each pointer is walked through the document as written
            node["$ref"] = _renamed_ref(schema, node["$ref"], renamed)
        for node in renamed.values():
            node["anyOf"] = node.pop("oneOf")
    return changed or bool(renamed)


def _prove_exclusive(prover: ExclusiveProver, node: dict, pointer: str) -> None:
    if "anyOf" in node:
        raise SchemaRefused("oneOf", pointer, "beside anyOf in one schema is not supported; move one of them "
                                              "into its own subschema")
    try:
        found = prover.overlap(node["oneOf"])
    except Unproven as exc:
        raise SchemaRefused("oneOf", pointer, f"is not provably exclusive: {exc}") from None
    if found is not None:
        i, j, why = found
        raise SchemaRefused("oneOf", pointer,
                            f"is not provably exclusive: branches {i} and {j} ({pointer}/oneOf/{i} and "
                            f"{pointer}/oneOf/{j}) may both match ({why}); give the branches distinct types, or "
                            "each a required property with a distinct const, or use anyOf")


def _renamed_ref(schema: Any, ref: Any, renamed: dict[int, dict]) -> Any:
    """``ref`` with each ``oneOf`` step through a renamed schema spelled ``anyOf``."""
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return ref
    tokens = [t.replace("~1", "/").replace("~0", "~") for t in urllib.parse.unquote(ref[1:]).split("/")[1:]]
    node, moved = schema, False
    for i, token in enumerate(tokens):
        if token == "oneOf" and isinstance(node, dict) and id(node) in renamed:
            tokens[i], moved = "anyOf", True
        node = node.get(token) if isinstance(node, dict) else \
            node[int(token)] if isinstance(node, list) and token.isdigit() and int(token) < len(node) else None
    if not moved:
        return ref
    return "#" + urllib.parse.quote("".join("/" + pointer_token(t) for t in tokens), safe="/~!$&'()*+,;=:@")

