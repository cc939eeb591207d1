"""Helpers of the /v1/responses tests: read a Responses event stream, and compare response
objects without their generated ids and times."""

from __future__ import annotations

import json

RESPONSES = "/v1/responses"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def events(text: str) -> list[dict]:
    """The events of an SSE body framed as OpenAI frames the Responses stream: each has an
    ``event:`` line naming its type, then one ``data:`` line; no ``[DONE]``."""
    out = []
    for frame in text.split("\n\n"):
        if not frame:
            continue
        head, data = frame.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), frame
        event = json.loads(data[len("data: "):])
        assert head[len("event: "):] == event["type"], frame
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def normalized(response: dict) -> dict:
    """``response`` with its id, times, item ids and call ids replaced by stable names."""
    out = json.loads(json.dumps(response))
    out["id"], out["created_at"] = "resp", 0
    if out["completed_at"] is not None:
        out["completed_at"] = 1
    for i, item in enumerate(out["output"]):
        item["id"] = f"item{i}"
        if "call_id" in item:
            item["call_id"] = f"call{i}"
    return out
