"""The OpenAPI schema, fuzzed with schemathesis against the running stack, and bad input
aimed at each of its fields.

The schema is the one the gateway serves at /openapi.json (built from its routes). Each
operation gets a bounded number of examples, positive (valid by the schema) and negative,
with no shrinking, from a fixed seed (derandomized: CI runs the same cases every time;
raise ``max_examples`` or drop ``derandomize`` locally to hunt for new failures). Checks: no
5xx, documented status codes, content types and headers, response bodies matching the
schema, and schema-violating bodies rejected with a 4xx.

Two adjustments keep the run short and make positive cases produce real generations:

- every generation body is clamped to at most 4 new tokens and 2 choices (a value that is
  already invalid is left alone, so negative cases stay negative);
- positive bodies are repaired for the rules a JSON schema cannot state (content required
  for non-assistant roles, tool_call_id on tool messages, ids inside the vocabulary,
  min_tokens <= max_tokens, stream_options only with stream, top_logprobs only with
  logprobs, non-empty stop strings, logit_bias keyed by token ids, top_k never 0, keys only
  on the variant that has them, priority 0 under the ring's default policy, exactly one of
  ``text`` and ``input_ids`` and at most one output constraint on ``/generate``, the lower
  bounds of counts, tool names the gateway accepts, ``tool_choice`` naming a listed tool, a
  ``json_schema`` object with that response format). Each of those rules has its own 400 test in
  tests/gateway/test_gateway_errors.py, tests/gateway/test_gateway_variants.py and (priority)
  tests/tokenizer/test_priority.py.

Schemathesis draws whole bodies and rarely reaches what breaks a server. The second half
(``test_every_field_...``, hypothesis over ``bad_values``) puts one dangerous value at a time
(nesting past the limits, 300 KiB strings, JSON text 10,000 deep, wrong types, numbers out
of every range, unknown keys, empty and 10,000-long lists) into an otherwise valid body, at
every field of chat, completions, ``/generate``, ``/v1/tokenize`` and ``/v1/detokenize`` that
the schema has: never a 5xx, never a hang, every service's ``/get_load`` back to zero, and no
traceback in any service's log.
"""

from __future__ import annotations

import copy
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from tests.helpers.bad_values import (
    OpenApi,
    Raw,
    dump_body,
    field_name,
    json_fields,
    json_shapes,
    json_value,
    nested,
    no_errors_logged,
    set_json,
)

MAX_NEW_TOKENS = 4
MAX_N = 2
VOCAB = 49152  # SmolLM2
_CLAMPS = {"max_tokens": MAX_NEW_TOKENS, "max_completion_tokens": MAX_NEW_TOKENS, "max_new_tokens": MAX_NEW_TOKENS,
           "max_output_tokens": MAX_NEW_TOKENS,
           "min_tokens": MAX_NEW_TOKENS, "min_new_tokens": MAX_NEW_TOKENS, "n": MAX_N}
GENERATION_PATHS = {"/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses"}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]

# The schema the gateway serves at /openapi.json is built from its routes alone (no peer).
OPENAPI = create_app(GatewayConfig()).openapi()
schema = schemathesis.openapi.from_dict(OPENAPI)
# Schemathesis's coverage phase (every field's boundary values, positive and negative) sends
# about 2,300 positive bodies to the four generation endpoints, each a generation: 55 s of the
# suite. Its negative half stays (each answered by the gateway's validation in milliseconds);
# positive bodies come from the examples and fuzzing phases, 10 an operation.
schema.config.phases.coverage.generation.modes = [GenerationMode.NEGATIVE]
# The fuzzing phase draws positive bodies only: drawn half and half, a generation endpoint got
# 4-5 positive bodies of its 10, too few to see that positives generate.
schema.config.phases.fuzzing.generation.modes = [GenerationMode.POSITIVE]
STATUSES: Counter = Counter()  # (operation, status) -> count, to see that positive cases generate


def _clamp(params: dict) -> None:
    for key, top in _CLAMPS.items():
        value = params.get(key)
        if type(value) is int and value > top:
            params[key] = top


def _ids(ids: object) -> object:
    return [i % VOCAB if type(i) is int else i for i in ids] if isinstance(ids, list) else ids


def _repair_sampling(params: dict, model: str) -> None:
    """Positive bodies only: the cross-field rules of the OpenAI and native sampling fields."""
    if "model" in params:
        params["model"] = model
    if "stream_options" in params and not params.get("stream"):
        del params["stream_options"]
    if isinstance(params.get("stop"), list):
        params["stop"] = [s for s in params["stop"] if s]
    if params.get("stop") == "":
        del params["stop"]
    params.pop("logit_bias", None)
    rf = params.get("response_format")
    if isinstance(rf, dict) and rf.get("type") != "json_schema":
        rf.pop("json_schema", None)
    if params.get("top_k") == 0:
        params["top_k"] = -1
    if isinstance(params.get("top_p"), float) and params["top_p"] < 1e-3:
        params["top_p"] = 1e-3
    if type(params.get("seed")) is int:
        params["seed"] %= 2**63
    for key in ("stop_token_ids", "input_ids"):
        params[key] = _ids(params.get(key)) if key in params else None
        if params[key] is None:
            del params[key]
    # Lower bounds the routes check themselves (the schema has no minimum for them).
    for key in ("max_tokens", "max_completion_tokens", "max_new_tokens", "n"):
        if type(params.get(key)) is int and params[key] < 1:
            params[key] = 1
    for key in ("logprobs", "top_logprobs", "prompt_logprobs"):
        if type(params.get(key)) is int:
            params[key] = min(max(params[key], 0), 20)
    if isinstance(rf, dict) and rf.get("type") == "json_schema" and not isinstance(rf.get("json_schema"), dict):
        params["response_format"] = {"type": "text"}
    for i, tool in enumerate(params.get("tools") or []):
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            tool["function"]["name"] = f"tool_{i}"  # 1-64 letters, digits, '_' or '-'
    if isinstance(params.get("tool_choice"), dict):
        params["tool_choice"] = "auto"  # a named function must be one of the tools
    top = params.get("max_tokens") or params.get("max_completion_tokens") or params.get("max_new_tokens")
    for key in ("min_tokens", "min_new_tokens"):
        if type(params.get(key)) is int and top:
            params[key] = min(params[key], top)


def _repair_messages(body: dict) -> None:
    messages = body.get("messages") or []
    for m in messages:
        if not isinstance(m, dict):
            continue
        if isinstance(m.get("content"), list):
            m["content"] = [{"type": "text", "text": p.get("text") or "hi"} for p in m["content"]] or "hi"
        if m.get("role") != "assistant" and m.get("content") is None:
            m["content"] = "hi"
        if m.get("role") == "assistant" and m.get("content") is None and not m.get("tool_calls"):
            m["content"] = "ok"
        if m.get("role") == "tool" and not m.get("tool_call_id"):
            m["tool_call_id"] = "call_0"
        if m.get("role") != "tool":
            m.pop("tool_call_id", None)
        if m.get("role") != "assistant":
            m.pop("tool_calls", None)
            m.pop("reasoning_content", None)
    if body.get("top_logprobs") is not None:
        body["logprobs"] = True
    if body.get("continue_final_message") and (body.get("add_generation_prompt") or not messages
                                               or messages[-1].get("role") != "assistant"):
        body["continue_final_message"] = False
    body.pop("chat_template_kwargs", None)


def _bound(case, model: str) -> None:
    """Clamp every generation body; repair positive ones (see the module docstring)."""
    body = case.body
    path = case.operation.path
    if path not in GENERATION_PATHS or not isinstance(body, dict):
        return
    positive = case.meta is not None and case.meta.generation.mode.value == "positive"
    if positive and "priority" in body:
        body["priority"] = 0  # any other is a 400 under --schedule-policy fcfs
    if path == "/generate":
        params = body.get("sampling_params", {} if positive else None)
        if isinstance(params, dict):
            body["sampling_params"] = params
            _clamp(params)
            if params.get("max_new_tokens") is None:
                params["max_new_tokens"] = MAX_NEW_TOKENS
            if positive:
                _repair_sampling(params, model)
                body["input_ids"] = _ids(body.get("input_ids")) if "input_ids" in body else None
                if body["input_ids"] is None:
                    del body["input_ids"]
                if "model" in body:
                    body["model"] = model
                constraints = [(where, k) for where in (body, params) for k in ("json_schema", "regex", "ebnf")
                               if where.get(k) is not None]
                for where, key in constraints[1:]:  # at most one output constraint
                    del where[key]
                if (body.get("text") is None) == ("input_ids" not in body):  # exactly one of the two
                    body.pop("input_ids", None)
                    body["text"] = "hi"
        return
    _clamp(body)
    if path == "/v1/responses":
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = MAX_NEW_TOKENS
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_NEW_TOKENS
    if positive:
        _repair_sampling(body, model)
        if path == "/v1/chat/completions":
            _repair_messages(body)
        elif isinstance(body.get("prompt"), list):
            body["prompt"] = [_ids(p) for p in body["prompt"]] if body["prompt"] and isinstance(
                body["prompt"][0], list) else _ids(body["prompt"])


@schema.parametrize()
@settings(max_examples=10, deadline=None, phases=[Phase.explicit, Phase.generate], derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_openapi_schema_fuzz(case, stack):
    _bound(case, stack.model_name)
    response = case.call_and_validate(base_url=stack.base_url, timeout=60, checks=CHECKS)
    STATUSES[(case.operation.label, response.status_code)] += 1


def test_fuzzing_generated_real_outputs(stack):
    """Runs after the fuzz (file order): positive cases of each generation endpoint got 200s."""
    if not STATUSES:
        return  # the fuzz test was deselected
    for label in ("POST /v1/chat/completions", "POST /v1/completions", "POST /generate"):
        assert STATUSES[(label, 200)] >= 3, STATUSES


# --- one bad value at a time, at every field -------------------------------------------------

API = OpenApi(OPENAPI)
BASES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 1}},
    "/v1/tokenize": {"messages": [{"role": "user", "content": "hi"}]},  # renders the chat template too
    "/v1/detokenize": {"tokens": [504]},
}
FIELDS = [(path, steps) for path in BASES for steps in json_fields(API, path)]


def _holds_containers(steps) -> bool:
    last = steps[-1]
    schema = last.schema["items"] if isinstance(last.key, int) else last.schema["properties"][last.key]
    return any(b.get("type") in ("object", "array", None) for b in API.branches(schema))


# Where nesting can pass validation: fields that take objects or arrays (a scalar field
# refuses any container by its type, the same check whatever the depth).
CONTAINER_FIELDS = [(path, steps) for path, steps in FIELDS if _holds_containers(steps)]


def idle_by_get_load(stack, timeout_s: float = 10.0) -> None:
    """Every service's ``/get_load`` entry back to zero (waits for aborts to land)."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = httpx.get(f"{stack.base_url}/get_load", timeout=10).json()
        held = ([t["req_states"] for t in load["tokenizer"]] + [d["decode_states"] for d in load["detokenizer"]]
                + [s[k] for s in load["scheduler"]
                   for k in ("num_running_reqs", "num_waiting_reqs", "req_slots_used", "kv_used_tokens")])
        if not any(held):
            return
        assert time.monotonic() < deadline, f"state not released: {load}"
        time.sleep(0.05)


def post_bad(client: httpx.Client, stack, path: str, steps, value) -> httpx.Response:
    marker = "\x00raw\x00"
    body = set_json(API, copy.deepcopy(BASES[path]), steps, marker if isinstance(value, Raw) else value)
    if path.startswith("/v1/"):
        body.setdefault("model", stack.model_name)
    raw = value if isinstance(value, Raw) else None
    r = client.post(stack.base_url + path, content=dump_body(body, raw, marker), timeout=60,  # a hang fails here
                    headers={"content-type": "application/json"})
    where = f"{path} {field_name(steps)}"
    # 429 too: this ring has no queue limits (it was a gRPC trailer too big to read).
    assert r.status_code < 500 and r.status_code != 429, (where, r.status_code, r.text[:500])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["type"] and error["message"], (where, r.text[:500])
    return r


@pytest.fixture
def client(stack):
    """An HTTP client on the ring whose log grows by no traceback and no ERROR line meanwhile."""
    with no_errors_logged(stack), httpx.Client() as c:
        yield c


def test_every_field_refuses_nesting_past_the_limits(stack, client):
    """Depth 600 objects at every field that takes objects or arrays: a 4xx each."""
    assert len(CONTAINER_FIELDS) >= 40
    for path, steps in CONTAINER_FIELDS:
        post_bad(client, stack, path, steps, nested(600))
    idle_by_get_load(stack)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.generate])
@given(field=st.sampled_from(FIELDS), shape=json_shapes)
def test_every_field_survives_bad_values(stack, client, field, shape):
    path, steps = field
    post_bad(client, stack, path, steps, json_value(shape))
    idle_by_get_load(stack)
