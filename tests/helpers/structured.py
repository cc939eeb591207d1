"""Helpers for the structured-output, tool-call and reasoning cases: one chat message as a
client sees it, assembled the same way from a body or from a stream (whose tool-call deltas
are checked as they come: T01's first-delta rule, T12's string arguments)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx

from tests.helpers.sse_reader import sse_events


@dataclass
class Message:
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict] = field(default_factory=list)  # {"id", "name", "arguments"} in index order
    finish_reason: str | None = None
    completion_tokens: int | None = None

    @property
    def args(self) -> list[object]:
        return [json.loads(c["arguments"]) for c in self.tool_calls]


def chat_body(model: str, messages: list[dict] | str, **extra) -> dict:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return {"model": model, "messages": messages, "temperature": 0, "max_tokens": 64, **extra}


def _from_body(choice: dict, usage: dict) -> Message:
    m = choice["message"]
    calls = []
    for c in m.get("tool_calls") or []:
        assert c["type"] == "function" and c["id"], c
        assert isinstance(c["function"]["arguments"], str), c  # T12
        calls.append({"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]})
    return Message(m["content"], m.get("reasoning_content"), calls, choice["finish_reason"], usage["completion_tokens"])


def _from_stream(events: list[dict], index: int) -> Message:
    msg = Message()
    content, reasoning = [], []
    calls: dict[int, dict] = {}
    for event in events:
        for c in event["choices"]:
            if c["index"] != index:
                continue
            d = c["delta"]
            if d.get("content"):
                content.append(d["content"])
            if d.get("reasoning_content"):
                reasoning.append(d["reasoning_content"])
            for tc in d.get("tool_calls") or []:
                assert isinstance(tc["function"]["arguments"], str), tc  # T12
                if tc["index"] not in calls:  # T01: the first delta of a call names it
                    assert tc["id"] and tc["type"] == "function" and tc["function"]["name"], tc
                    calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
                else:  # later deltas never change id, type or name
                    assert "id" not in tc and "type" not in tc and "name" not in tc["function"], tc
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
            if c["finish_reason"] is not None:
                msg.finish_reason = c["finish_reason"]
    assert sorted(calls) == list(range(len(calls))), sorted(calls)  # indexes 0, 1, 2, ...
    assert len({c["id"] for c in calls.values()}) == len(calls)  # each call its own id
    msg.content = "".join(content) or None
    msg.reasoning = "".join(reasoning) or None
    msg.tool_calls = [calls[i] for i in sorted(calls)]
    return msg


async def chat(client: httpx.AsyncClient, body: dict, stream: bool) -> list[Message]:
    """One Message per choice; 200 expected. T08 is checked on every one."""
    body = {**body, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    if stream:
        events = sse_events(resp)
        indexes = sorted({c["index"] for e in events for c in e["choices"]})
        messages = [_from_stream(events, i) for i in indexes]
        usage = events[-1]["usage"]
        for m in messages:
            m.completion_tokens = usage["completion_tokens"] if len(messages) == 1 else None
    else:
        data = resp.json()
        messages = [_from_body(c, data["usage"]) for c in sorted(data["choices"], key=lambda c: c["index"])]
        if len(messages) > 1:
            for m in messages:
                m.completion_tokens = None
    for m in messages:  # T08: "tool_calls" exactly when there are calls, unless max_tokens cut one ("length")
        assert (m.finish_reason == "tool_calls") == bool(m.tool_calls) or m.finish_reason == "length", m
    return messages


async def error_of(client: httpx.AsyncClient, body: dict, stream: bool, path: str = "/v1/chat/completions") -> dict:
    """The OpenAI error object of a refused request: 400 with a JSON body, no SSE byte."""
    resp = await client.post(path, json={**body, "stream": stream})
    assert resp.status_code == 400, resp.text
    assert resp.headers["content-type"].startswith("application/json"), resp.headers
    return resp.json()["error"]
