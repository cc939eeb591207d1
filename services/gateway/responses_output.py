"""One response's output items and stream events, built from the choice's streamed updates.

The chat parsers (``chat_output.ChoiceParser``: reasoning, then tool calls, then content)
split each chunk; each kind of piece goes to its output item, opened the first time that
kind appears: a ``reasoning`` item (closed when the content or a call starts), one
``message`` with one ``output_text`` part, and one ``function_call`` item per call, in the
order they open (``output_index``). Text of only blanks beside function calls is no message;
an answer with no call has one (even an empty one), unless it was cut off inside its
reasoning. The events are the Responses API's,
numbered by ``sequence_number`` from 0; a non-streamed response is built by the same code
from the same chunks (the tokenizer streams both), so it equals the streamed one's final
response.

Usage: ``output_tokens_details.reasoning_tokens`` counts the output tokens up to the last
chunk before the content or a call starts (the closing tag's included), when reasoning was
written; ``input_tokens_details.cache_write_tokens`` is 0 (prompt caching is automatic
here, with no explicit cache writes).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from .chat_output import ChoiceDelta, ChoiceParser
from .errors import GatewayError
from .outputs import ChoiceUpdate, Usage
from .responses_protocol import ResponsesRequest

# HTTP status of an error after the stream started -> the Responses error code.
_ERROR_CODES = {400: "invalid_prompt", 429: "rate_limit_exceeded"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def echo(req: ResponsesRequest, store: bool) -> dict:
    """The request's settings as the response object repeats them."""
    fmt = req.text.format if req.text is not None else None
    choice = req.tool_choice
    return {
        "background": False,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": store,
        "temperature": req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump() if choice else "auto",
        "tools": [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                   "strict": t.strict is not False} for t in req.tools or ()],
        "top_p": req.top_p,
        "truncation": "disabled",
        "user": req.user,
    }


@dataclass
class _Item:
    kind: str  # "message", "reasoning" or "function_call"
    id: str
    index: int  # output_index
    call_id: str = ""
    name: str = ""
    pieces: list[str] = field(default_factory=list)
    status: str = "in_progress"

    def text(self) -> str:
        return "".join(self.pieces)

    def part(self, text: str) -> dict:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def body(self, empty: bool = False) -> dict:
        """The item as the API shows it (``empty``: as added, before any text)."""
        text = "" if empty else self.text()
        if self.kind == "function_call":
            return {"id": self.id, "type": "function_call", "call_id": self.call_id, "name": self.name,
                    "arguments": text, "status": self.status}
        content = [] if empty else [self.part(text)]
        if self.kind == "reasoning":
            return {"id": self.id, "type": "reasoning", "summary": [], "content": content, "status": self.status}
        return {"id": self.id, "type": "message", "role": "assistant", "status": self.status, "content": content}


class ResponseBuilder:
    """The output of one response: ``feed`` each update, then ``finish`` (or ``fail``); each
    returns the stream events it caused, and ``response()`` is the response object now."""

    def __init__(self, head: dict, make_parser: Callable[[bool], ChoiceParser] | None, usage: Usage):
        self.head = head  # id, object, created_at, model and the echoed settings
        self.usage = usage
        self._make_parser = make_parser
        self._parser: ChoiceParser | None = None
        self._seq = 0
        self._items: list[_Item] = []
        self._reasoning: _Item | None = None
        self._message: _Item | None = None
        self._calls: dict[int, _Item] = {}
        self._blank = ""  # content of only blanks so far, held until it is more (or the end)
        self._reasoning_over = False
        self._reasoning_tokens = 0
        self.status = "in_progress"
        self._incomplete: dict | None = None
        self._error: dict | None = None
        self._completed_at: int | None = None

    def _event(self, kind: str, **fields: object) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def response(self) -> dict:
        """The response object as it stands."""
        u = self.usage
        usage = None
        if self.status != "in_progress":
            prompt, cached, output = sum(u.prompt.values()), sum(u.cached.values()), sum(u.completion.values())
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                     "output_tokens": output, "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens},
                     "total_tokens": prompt + output}
        return {**self.head, "status": self.status, "completed_at": self._completed_at, "error": self._error,
                "incomplete_details": self._incomplete, "output": [i.body() for i in self._items], "usage": usage}

    def start(self) -> list[dict]:
        snapshot = self.response()
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    # --- items ---------------------------------------------------------------------------

    def _open(self, kind: str, prefix: str, call_id: str = "", name: str = "") -> tuple[_Item, list[dict]]:
        item = _Item(kind, new_id(prefix), len(self._items), call_id, name)
        self._items.append(item)
        events = [self._event("response.output_item.added", output_index=item.index, item=item.body(empty=True))]
        if kind != "function_call":
            events.append(self._event("response.content_part.added", item_id=item.id, output_index=item.index,
                                      content_index=0, part=item.part("")))
        return item, events

    def _add(self, item: _Item, text: str) -> list[dict]:
        if not text:
            return []
        item.pieces.append(text)
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "function_call":
            return [self._event("response.function_call_arguments.delta", **where, delta=text)]
        if item.kind == "reasoning":
            return [self._event("response.reasoning_text.delta", **where, content_index=0, delta=text)]
        return [self._event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])]

    def _close(self, item: _Item, status: str) -> list[dict]:
        item.status = status
        where = {"item_id": item.id, "output_index": item.index}
        text = item.text()
        if item.kind == "function_call":
            events = [self._event("response.function_call_arguments.done", **where, name=item.name, arguments=text)]
        else:
            done = "response.reasoning_text.done" if item.kind == "reasoning" else "response.output_text.done"
            extra: dict = {"logprobs": []} if item.kind == "message" else {}
            events = [self._event(done, **where, content_index=0, text=text, **extra),
                      self._event("response.content_part.done", **where, content_index=0, part=item.part(text))]
        return [*events, self._event("response.output_item.done", output_index=item.index, item=item.body())]

    def _end_reasoning(self, status: str = "completed") -> list[dict]:
        self._reasoning_over = True
        reasoning, self._reasoning = self._reasoning, None
        return self._close(reasoning, status) if reasoning is not None else []

    def _content(self, text: str) -> list[dict]:
        if self._message is None:
            self._blank += text
            if not self._blank.strip():
                return []
            self._message, events = self._open("message", "msg")
            text, self._blank = self._blank, ""
            return events + self._add(self._message, text)
        return self._add(self._message, text)

    # --- updates -------------------------------------------------------------------------

    def feed(self, u: ChoiceUpdate) -> list[dict]:
        """The events of one update of the choice."""
        final = u.finish_reason is not None
        if self._make_parser is None:
            d = ChoiceDelta(content=u.text)
        else:
            if self._parser is None:
                self._parser = self._make_parser(u.out.reasoning_open)
            d = self._parser.feed(u.text, final=final)
        events: list[dict] = []
        if d.reasoning:
            if self._reasoning is None:
                self._reasoning, events = self._open("reasoning", "rs")
            events += self._add(self._reasoning, d.reasoning)
        if not self._reasoning_over:
            if d.content or d.calls:
                events += self._end_reasoning()
            elif self._items:  # still inside the reasoning: its tokens so far are reasoning tokens
                self._reasoning_tokens = u.out.completion_tokens
        if d.content:
            events += self._content(d.content)
        for call in d.calls:
            item = self._calls.get(call.index)
            if item is None:
                item, opened = self._open("function_call", "fc", call_id=call.id or "", name=call.name or "")
                self._calls[call.index] = item
                events += opened
            events += self._add(item, call.arguments)
        return events

    def finish(self, reason: str | None) -> list[dict]:
        """Close every open item and end the response: "stop" completes it, "length" leaves it
        incomplete (max_output_tokens), an operator's abort fails it."""
        if reason == "length":
            self.status, self._incomplete = "incomplete", {"reason": "max_output_tokens"}
        elif reason == "stop":
            self.status = "completed"
        else:
            self.status, self._error = "failed", {"code": "server_error", "message": "the request was aborted"}
        item_status = "completed" if self.status == "completed" else "incomplete"
        events = self._end_reasoning(item_status)
        if self._message is None and not self._calls and (self.status == "completed" or not self._items):
            self._message, opened = self._open("message", "msg")
            events += opened + self._add(self._message, self._blank)
        for item in self._items:
            if item.status == "in_progress":
                events += self._close(item, item_status)
        if self.status == "completed":
            self._completed_at = int(time.time())
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(self.status,
                                                                                            "response.failed")
        return [*events, self._event(kind, response=self.response())]

    def fail(self, exc: GatewayError) -> list[dict]:
        """The one event of an error after the stream started: ``response.failed``."""
        self.status = "failed"
        self._error = {"code": _ERROR_CODES.get(exc.status, "server_error"), "message": exc.message}
        return [self._event("response.failed", response=self.response())]
