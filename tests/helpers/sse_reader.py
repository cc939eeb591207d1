"""HTTP helpers for the acceptance-case tests (tests/e2e/test_cases_*.py).

A streamed body is read whole and split into events with its framing checked byte for
byte; a non-stream body is folded into the same per-choice shape, so a test compares the
two directly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx

DONE = b"data: [DONE]\n\n"


def sse_events(resp: httpx.Response) -> list[dict]:
    """The JSON events of an SSE response, after checking its framing.

    Framing (C07): ``Content-Type: text/event-stream``; every event is exactly
    ``data: <one-line JSON>\\n\\n``; the body ends with one ``data: [DONE]\\n\\n`` and
    nothing after it.
    """
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].split(";")[0] == "text/event-stream"
    raw = resp.content
    assert raw.endswith(DONE) and raw.count(DONE) == 1, raw[-200:]
    frames = raw[: -len(DONE)].split(b"\n\n")
    assert frames[-1] == b"", frames[-1]  # every event ends with its blank line
    events = []
    for frame in frames[:-1]:
        assert frame.startswith(b"data: ") and b"\n" not in frame and b"\r" not in frame, frame
        events.append(json.loads(frame[len(b"data: ") :]))
    return events


@dataclass
class Choice:
    """One choice as a client sees it: its deltas (one, the whole text, when not streamed)."""

    deltas: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None

    @property
    def text(self) -> str:
        return "".join(self.deltas)


@dataclass
class Result:
    choices: dict[int, Choice]
    usage: dict | None
    events: list[dict]  # stream only

    @property
    def only(self) -> Choice:
        assert list(self.choices) == [0]
        return self.choices[0]


def _choice_text(choice: dict, stream: bool) -> str:
    if "text" in choice:  # completions
        return choice["text"]
    part = choice["delta"] if stream else choice["message"]
    return part.get("content") or ""


async def call(client: httpx.AsyncClient, body: dict) -> Result:
    """POST ``body`` to /v1/completions (it has a prompt) or /v1/chat/completions; 200 expected."""
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    resp = await client.post(path, json=body)
    if not body.get("stream"):
        assert resp.status_code == 200, resp.text
        data = resp.json()
        choices = {
            c["index"]: Choice([_choice_text(c, False)], c["finish_reason"], c.get("matched_stop"))
            for c in data["choices"]
        }
        return Result(choices, data["usage"], [])
    events = sse_events(resp)
    choices: dict[int, Choice] = {}
    usage = None
    for event in events:
        if not event["choices"]:
            usage = event["usage"]
        for c in event["choices"]:
            choice = choices.setdefault(c["index"], Choice())
            assert choice.finish_reason is None, f"choice {c['index']} has a chunk after its finish chunk"
            choice.deltas.append(_choice_text(c, True))
            choice.finish_reason, choice.matched_stop = c["finish_reason"], c.get("matched_stop")
    return Result(choices, usage, events)
