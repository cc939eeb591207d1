"""Every string slot of every POST endpoint's request schema, read from the gateway's OpenAPI
schema, and bodies that put a given string in one slot.

A slot is a path from the body's root to a place where the schema allows a string: a string
property, a string array item, a free-form object's value or key. ``body_with`` starts from a
minimal valid body of the endpoint and fills in the minimal required objects on the way.
Shared by the gateway test (fake tokenizer) and the end-to-end one (the real ring).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig

# A valid body per endpoint; a slot is filled on top of it.
BASES: dict[str, dict] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    "/v1/tokenize": {"prompt": "hi"},
    "/v1/detokenize": {"tokens": [1]},
    "/abort_request": {"rid": "r"},
    "/v1/embeddings": {"input": "hi"},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    # A path the fake tokenizer refuses (tests/gateway/conftest.py): nothing is loaded.
    "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/elsewhere/a"},
    "/v1/unload_lora_adapter": {"lora_name": "a"},
}

KEY = "<key>"  # path segment: a free-form object's key


def _schema() -> dict:
    return create_app(GatewayConfig(tokenizer="127.0.0.1:1")).openapi()


def _resolve(node: dict, defs: dict) -> dict:
    while "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[-1]]
    return node


def _options(node: dict, defs: dict) -> list[dict]:
    node = _resolve(node, defs)
    if "anyOf" in node or "oneOf" in node:
        return [o for sub in node.get("anyOf", node.get("oneOf")) for o in _options(sub, defs)]
    return [node]


def _slots(node: dict, defs: dict, path: tuple, seen: frozenset) -> list[tuple]:
    out: list[tuple] = []
    for opt in _options(node, defs):
        kind = opt.get("type")
        if kind == "string" and "enum" not in opt and "const" not in opt:
            out.append(path)
        elif kind == "array" and "items" in opt:
            out += _slots(opt["items"], defs, (*path, 0), seen)
        elif kind == "object" or "properties" in opt:
            title = opt.get("title")
            if title in seen:
                continue
            for name, sub in opt.get("properties", {}).items():
                out += _slots(sub, defs, (*path, name), seen | {title})
            extra = opt.get("additionalProperties")
            if "properties" not in opt and extra is None:
                extra = True  # a free-form object
            if extra is True or isinstance(extra, dict):
                out.append((*path, KEY))  # a JSON object's keys are strings whatever its values
            if extra is True or (isinstance(extra, dict) and (not extra or _slots(extra, defs, (), seen))):
                out.append((*path, "k"))
    return list(dict.fromkeys(out))


def endpoint_slots() -> dict[str, list[tuple]]:
    """{path: [slot, ...]} for every POST endpoint with a JSON body."""
    schema = _schema()
    defs = schema["components"]["schemas"]
    out = {}
    for route, ops in schema["paths"].items():
        post = ops.get("post", {})
        body = post.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
        if body is not None:
            out[route] = _slots(body, defs, (), frozenset())
    return out


MARK = "\u2603MARK\u2603"


def body_with(route: str, slot: tuple, value: str) -> dict:
    """The base body of ``route`` with ``value`` at ``slot`` (a key slot puts it in a key)."""
    body = copy.deepcopy(BASES[route])
    node: Any = body
    for i, seg in enumerate(slot[:-1]):
        nxt = slot[i + 1]
        empty: Any = [] if isinstance(nxt, int) else {}
        if isinstance(seg, int):
            if not node:
                node.append(_filler(slot[: i + 1], route))
            if not isinstance(node[0], type(empty)):
                node[0] = empty
            node = node[0]
        else:
            if seg == KEY:
                break
            if not isinstance(node.get(seg), (list, dict)) or not isinstance(node.get(seg), type(empty)):
                node[seg] = _filler(slot[: i + 1], route) if isinstance(nxt, str) and nxt != KEY else empty
            node = node[seg]
    last = slot[-1]
    if last == KEY:
        node[value] = 1
    elif isinstance(last, int):
        node[:] = [value]
    else:
        node[last] = value
    return body


def _filler(prefix: tuple, route: str) -> Any:
    """The minimal valid object at a path prefix (a message needs a role, a tool a function...)."""
    name = next((s for s in reversed(prefix) if isinstance(s, str)), "")
    return {
        "messages": {"role": "user", "content": "hi"},
        "tools": {"type": "function", "function": {"name": "f"}},
        "function": {"name": "f"},
        "tool_calls": {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "content": {"type": "text", "text": "hi"},
        "stream_options": {},
    }.get(name, {})


def raw_body(body: dict, value: str, raw: str) -> bytes:
    """``body`` as JSON with the string ``value`` (a marker) replaced by the raw JSON text
    ``raw`` (which may hold escapes JSON allows but UTF-8 cannot hold, or invalid ones)."""
    text = json.dumps(body, ensure_ascii=False)
    return text.replace(json.dumps(value, ensure_ascii=False), raw).encode("utf-8", "surrogatepass")
