"""The response store: GET and DELETE /v1/responses/{id} in OpenAI's shapes (404 for an
unknown id), previous_response_id continuing a stored conversation (its inputs and outputs
before the new input; instructions not carried over), store: false, and the LRU's bounds."""

from __future__ import annotations

from services.gateway.responses_protocol import MessageItem
from services.gateway.responses_store import ResponseStore, Stored, items_bytes
from tests.helpers.gateway_requests import assert_error
from tests.helpers.responses_events import RESPONSES, WEATHER, events


async def _create(stack, *steps, **body) -> dict:
    stack.fake.reset(*steps)
    r = await stack.client.post(RESPONSES, json={"model": stack.model, **body})
    assert r.status_code == 200, r.text
    return r.json() if not body.get("stream") else events(r.text)[-1]["response"]


def _messages(fake) -> list[tuple]:
    return [(m.role, m.content, [(c.id, c.function_name, c.function_arguments) for c in m.tool_calls],
             m.tool_call_id) for m in fake.requests[-1].chat.messages]


async def test_a_stored_response_is_retrieved_and_deleted(stack):
    for stream in (False, True):
        created = await _create(stack, stack.out("Hi", finish="stop"), input="hi", stream=stream)
        assert created["store"] is True
        r = await stack.client.get(f"{RESPONSES}/{created['id']}")
        assert r.status_code == 200 and r.json() == created
        r = await stack.client.delete(f"{RESPONSES}/{created['id']}")
        assert r.status_code == 200 and r.json() == {"id": created["id"], "object": "response", "deleted": True}
        for method in ("GET", "DELETE"):
            r = await stack.client.request(method, f"{RESPONSES}/{created['id']}")
            err = assert_error(r, 404, None, "response_not_found", "not_found_error")
            assert created["id"] in err["message"]


async def test_store_false_keeps_nothing(stack):
    created = await _create(stack, stack.out("Hi", finish="stop"), input="hi", store=False)
    assert created["store"] is False
    assert_error(await stack.client.get(f"{RESPONSES}/{created['id']}"), 404, None, "response_not_found",
                 "not_found_error")
    r = await stack.client.post(RESPONSES, json={"model": stack.model, "input": "more",
                                                 "previous_response_id": created["id"]})
    assert_error(r, 404, "previous_response_id", "response_not_found", "not_found_error")


async def test_a_query_parameter_is_refused_by_name(stack):
    created = await _create(stack, stack.out("Hi", finish="stop"), input="hi")
    r = await stack.client.get(f"{RESPONSES}/{created['id']}", params={"stream": "true"})
    assert_error(r, 400, "stream", "unsupported_parameter")


async def test_previous_response_id_continues_the_conversation(stack):
    first = await _create(stack, stack.out("Paris.", finish="stop"), input="Capital of France?",
                          instructions="Be brief.")
    second = await _create(stack, stack.out("Berlin.", finish="stop"), input="And Germany?",
                           previous_response_id=first["id"], instructions="Be terse.")
    assert second["previous_response_id"] == first["id"]
    assert _messages(stack.fake) == [("system", "Be terse.", [], ""), ("user", "Capital of France?", [], ""),
                                     ("assistant", "", [], ""), ("user", "And Germany?", [], "")]
    assert [p.text for p in stack.fake.requests[-1].chat.messages[2].content_parts] == ["Paris."]
    await _create(stack, stack.out("Rome.", finish="stop"), input="And Italy?", previous_response_id=second["id"])
    assert [m.role for m in stack.fake.requests[-1].chat.messages] == ["user", "assistant", "user", "assistant",
                                                                       "user"]


async def test_a_tool_loop_over_previous_response_id(stack):
    call = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    first = await _create(stack, stack.out(call, finish="stop"), input="Weather in Paris?", tools=[WEATHER],
                          tool_choice="required", stream=True)
    fc = first["output"][0]
    output = {"type": "function_call_output", "call_id": fc["call_id"], "output": "18C"}
    await _create(stack, stack.out("18C in Paris.", finish="stop"), input=[output], tools=[WEATHER],
                  previous_response_id=first["id"])
    assert _messages(stack.fake) == [
        ("user", "Weather in Paris?", [], ""),
        ("assistant", "", [(fc["call_id"], "get_weather", '{"city": "Paris"}')], ""),
        ("tool", "18C", [], fc["call_id"]),
    ]


def _entry(rid: str, text: str = "x") -> Stored:
    items = (MessageItem(role="user", content=text),)
    return Stored({"id": rid, "output": []}, items, items_bytes(items))


def test_the_store_evicts_the_least_recently_used():
    store = ResponseStore(max_responses=2, max_bytes=10**6)
    for rid in ("a", "b"):
        assert store.put(_entry(rid))
    assert store.get("a") is not None  # now b is the least recently used
    store.put(_entry("c"))
    assert [rid for rid in "abc" if store.get(rid)] == ["a", "c"] and len(store) == 2


def test_the_store_holds_at_most_its_bytes():
    size = len(b'{"id":"a","output":[]}') + items_bytes((MessageItem(role="user", content="x" * 100),))
    store = ResponseStore(max_responses=100, max_bytes=2 * size)
    for rid in "abc":
        assert store.put(_entry(rid, "x" * 100))
        assert store.bytes <= 2 * size
    assert [rid for rid in "abc" if store.get(rid)] == ["b", "c"] and store.bytes == 2 * size
    assert not store.put(_entry("d", "x" * 10_000))  # alone over the budget: not kept
    assert store.get("d") is None and len(store) == 2
    assert store.delete("b") and not store.delete("b") and store.bytes == size


def test_a_store_of_size_zero_keeps_nothing():
    store = ResponseStore(0, 10**6)
    assert not store.enabled and not store.put(_entry("a")) and store.get("a") is None


async def test_an_integer_past_64_bits_in_an_echoed_item_is_stored_and_streamed(stack):
    """JSON has no integer bound: a client's output_text item (as another server returned it)
    may carry logprobs with a 27-digit integer, which orjson cannot encode. Found by the schema
    fuzz: the stream was cut after its last event when the store measured the conversation."""
    big = 428154445087400337919180800
    item = {"type": "message", "role": "assistant",
            "content": [{"type": "output_text", "text": "Hi.", "annotations": [], "logprobs": [{"x": big}]}]}
    for stream in (False, True):
        created = await _create(stack, stack.out("Hi", finish="stop"), stream=stream,
                                input=[{"role": "user", "content": "hi"}, item, {"role": "user", "content": "again"}],
                                metadata={"n": "1"}, tools=[{"type": "function", "name": "f",
                                                             "parameters": {"type": "integer", "maximum": big}}])
        assert created["status"] == "completed"
        assert created["tools"][0]["parameters"]["maximum"] == big
        r = await stack.client.get(f"{RESPONSES}/{created['id']}")
        assert r.status_code == 200 and r.json() == created
