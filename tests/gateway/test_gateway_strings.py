"""A string that cannot be encoded as UTF-8 (a lone surrogate, which
JSON's ``\\udfff`` escape allows), in any string field of any endpoint, is a 400 naming the
field, never a 500; NULs and invalid escapes are never a 5xx either; the connection stays
usable. The fields come from the gateway's own OpenAPI schema, so a new field is covered
without touching this test."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.string_slots import BASES, KEY, MARK, body_with, endpoint_slots, raw_body

asyncio = pytest.mark.asyncio(loop_scope="session")

SLOTS = endpoint_slots()
ALL = [(route, slot) for route, slots in SLOTS.items() for slot in slots]
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))

surrogate = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
plain = st.characters(blacklist_categories=("Cs",))


@st.composite
def unencodable(draw) -> str:
    """Text holding at least one lone surrogate (so it is never valid UTF-8)."""
    head = draw(st.text(plain, max_size=5))
    return head + draw(surrogate) + draw(st.text(plain | surrogate, max_size=5))


# Raw JSON string literals: invalid escapes and raw control characters are invalid JSON;
# a surrogate's UTF-8-style bytes (ED BF BF, not valid UTF-8) decode, as Python's json reads
# bytes, to the lone surrogate itself.
INVALID_RAW = st.sampled_from([
    ('"\\x41"', "invalid_json"), ('"\\u12"', "invalid_json"), ('"\\uZZZZ"', "invalid_json"),
    ('"a\\"', "invalid_json"), ('"\\ud800\\u"', "invalid_json"), ('"\x01"', "invalid_json"),
    ('"\n"', "invalid_json"), ('"\\q"', "invalid_json"), ('"\udfff"', "invalid_encoding"),
])


def slot_path(slot: tuple, value: str) -> str:
    parts: list[str] = []
    for seg in slot:
        if isinstance(seg, int):
            parts.append(f"[{seg}]")
        else:
            name = value.encode("utf-8", "backslashreplace").decode() if seg == KEY else seg
            parts.append(("." if parts else "") + name)
    return "".join(parts)


def test_every_endpoint_has_string_slots():
    assert set(SLOTS) == set(BASES)
    assert ("messages", 0, "content") in SLOTS["/v1/chat/completions"]
    assert ("tools", 0, "function", "parameters", KEY) in SLOTS["/v1/chat/completions"]
    assert ("sampling_params", "stop", 0) in SLOTS["/generate"]
    # 26 by the output-constraint fields, 4 by /v1/embeddings, 36 by /v1/responses, 4 by LoRA
    assert sum(map(len, SLOTS.values())) == 130


async def still_usable(stack) -> None:
    stack.fake.reset(stack.out("ok", finish="stop"))
    r = await stack.client.post("/v1/chat/completions", json={"model": stack.model, **BASES["/v1/chat/completions"]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "ok"


@asyncio
@pytest.mark.parametrize("route,slot", ALL, ids=[f"{r}:{'.'.join(map(str, s))}" for r, s in ALL])
async def test_lone_surrogate_is_400_naming_the_field(stack, route, slot):
    stack.fake.reset(stack.out("never", finish="stop"))
    stack.fake.tokenize_requests.clear()
    value = "a\udfffb"
    body = body_with(route, slot, value)
    if route != "/abort_request":
        body = {"model": stack.model, **body}
    content = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as the escape \udfff
    r = await stack.client.post(route, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    path = slot_path(slot, value)
    assert err["code"] == "invalid_encoding", err
    assert err["param"] == path.split(".")[0].split("[")[0]
    assert err["message"] == f"'{path}' cannot be encoded as UTF-8: lone surrogate U+DFFF at index 1", err
    assert stack.fake.requests == [] and stack.fake.tokenize_requests == [], "nothing may reach the tokenizer"
    await still_usable(stack)


@asyncio
@FUZZ
@given(data=st.data())
async def test_no_string_gives_5xx(stack, data):
    route, slot = data.draw(st.sampled_from(ALL))
    kind = data.draw(st.sampled_from(["surrogate", "nul", "invalid"]))
    if kind == "surrogate":
        value = data.draw(unencodable())
        raw = json.dumps(value)
    elif kind == "nul":
        value = data.draw(st.text(plain, max_size=4)) + "\x00" + data.draw(st.text(plain, max_size=4))
        raw = json.dumps(value)
    else:
        value, (raw, code) = MARK, data.draw(INVALID_RAW)
    body = body_with(route, slot, value if kind != "invalid" else MARK)
    if route != "/abort_request":
        body = {"model": stack.model, **body}
    content = raw_body(body, MARK, raw) if kind == "invalid" else json.dumps(body).encode()
    stack.fake.reset(stack.out("ok", finish="stop"))
    r = await stack.client.post(route, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, (route, slot, kind, r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    if kind != "nul":
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == ("invalid_encoding" if kind == "surrogate" else code)
    await still_usable(stack)


@asyncio
@pytest.mark.parametrize("raw", ["%ED%BF%BF", "%FF", "%00", "a%C3"])
async def test_model_path_with_bad_bytes(stack, raw):
    r = await stack.client.get(f"/v1/models/{raw}")
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"
