"""Model output text -> OpenAI tool calls, incrementally (one parser per choice).

A parser is fed the choice's text as it arrives and returns the content the client may
see now and the tool-call deltas; ``finish`` flushes what it held back (a partial tag at
the end). The non-streamed response feeds the whole text once through the same code, so
the streamed deltas joined always equal the non-streamed fields. A call's ``arguments``
is the JSON text of its arguments exactly as the model wrote it (a forced call's is valid
JSON by construction); the first delta of each call carries its index, id, type and
name, later ones only argument fragments.

Formats (``--tool-call-parser``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere
  in the text, the rest is content (NousResearch Hermes 2/3, Qwen2.5, Qwen3, and
  ringserve/templates/chatml_tools.jinja, which the tokenizer renders with for a ChatML
  model whose own template renders no tools, such as SmolLM2).
- ``llama3_json``: the whole output is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``), several separated by ``;`` (Llama 3.1/3.2/3.3).
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects
  (Mistral 7B v0.3, Mixtral 8x22B, Mistral Small/Nemo); text before the marker is content.
- ``pythonic``: the whole output is a Python list of calls, ``[get_weather(city="Paris",
  days=3), get_time()]``, keyword arguments as Python literals (Llama 3.2 and Llama 4 with
  their pythonic templates, ToolACE); each call is sent once its closing parenthesis has
  arrived, its arguments as JSON.
- the forced format (tool_choice "required" or a named function, enforced by a grammar,
  whatever the model): a JSON array ``[{"name": ..., "arguments": {...}}, ...]``.
"""

from __future__ import annotations

import json
from typing import cast

from ringserve.options import names

from .tool_call_scanner import CallScanner, ToolCallDelta, new_call_id


class ToolParser:
    """Base: feed text, get (content, call deltas); ``calls`` counts the calls started."""

    calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._call: CallScanner | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content, deltas = [], []
        while self._buf:
            if self._call is None:
                at = self._buf.find(self.OPEN)
                if at < 0:
                    keep = partial_suffix(self._buf, self.OPEN)
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                content.append(self._buf[:at])
                self._buf = self._buf[at + len(self.OPEN) :]
                self._call = CallScanner(self.calls)
                self.calls += 1
                continue
            call = self._call
            if call.end is None:
                start = len(call.text)
                deltas += call.feed(self._buf)
                used = (call.end - start) if call.end is not None else len(self._buf)
                self._buf = self._buf[used:]
                if call.end is None:
                    break
            at = self._buf.find(self.CLOSE)
            if at < 0:
                break  # the object is complete: wait for its closing tag (what lies between is dropped)
            deltas += call.finish()
            self._buf = self._buf[at + len(self.CLOSE) :]
            self._call = None
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        call, rest = self._call, self._buf
        self._buf, self._call = "", None
        if call is None:
            return rest, []
        if call.name is None:  # never became a call (no name): the client sees the text as written
            self.calls -= 1
            return self.OPEN + call.text, []
        return "", call.finish()


class JsonCallsParser(ToolParser):
    """Calls as JSON objects at the top level: the forced array format (``[{...}, {...}]``)
    and Llama 3's ``{...}; {...}``. Between calls, anything outside the objects is
    punctuation. Output that does not open with ``[`` or ``{`` (after the prefix) is content,
    and so is the whole output when no call in it gets a name (cut short, or not a call):
    the text is held back until a call is named, and never dropped."""

    def __init__(self, prefix: str = "") -> None:
        self._prefix = prefix  # skipped once at the start (Llama 3's <|python_tag|>)
        self._buf = ""
        self._call: CallScanner | None = None
        self._content: bool | None = None  # decided by the first character after blanks and the prefix
        self._held = ""  # everything fed until a call is named: the content if none is
        self._named = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._content:
            return text, []
        if not self._named:
            self._held += text
        self._buf += text
        if self._content is None:
            head = self._buf.lstrip()
            if self._prefix and len(head) < len(self._prefix) and self._prefix.startswith(head):
                return "", []  # may still become the prefix
            if self._prefix and head.startswith(self._prefix):
                head = head[len(self._prefix) :].lstrip()
            if not head:
                return "", []
            self._content = head[0] not in "[{"
            if self._content:
                out, self._held, self._buf = self._held, "", ""
                return out, []
            self._buf = head
        return "", self._named_now(self._scan())

    def _scan(self) -> list[ToolCallDelta]:
        deltas = []
        while self._buf:
            if self._call is None:
                at = self._buf.find("{")
                if at < 0:
                    self._buf = ""
                    break
                self._buf = self._buf[at:]
                self._call = CallScanner(self.calls)
                self.calls += 1
            call = self._call
            start = len(call.text)
            deltas += call.feed(self._buf)
            if call.end is None:
                self._buf = ""
                break
            self._buf = self._buf[call.end - start :]
            deltas += call.finish()
            self._call = None
        return deltas

    def _named_now(self, deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
        if not self._named and any(d.id is not None for d in deltas):
            self._named, self._held = True, ""  # what was held is the calls' format
        return deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        deltas = self._named_now(self._call.finish() if self._call is not None else [])
        if self._named or self._content:
            return "", deltas
        held, self._held = self._held, ""
        return held, deltas


class MistralToolParser(ToolParser):
    """Content until ``[TOOL_CALLS]``, then the calls as a JSON array."""

    MARKER = "[TOOL_CALLS]"

    def __init__(self) -> None:
        self._buf = ""
        self._calls: JsonCallsParser | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._calls is not None:
            out = self._calls.feed(text)
            self.calls = self._calls.calls
            return out
        self._buf += text
        at = self._buf.find(self.MARKER)
        if at < 0:
            keep = partial_suffix(self._buf, self.MARKER)
            content, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
            return content, []
        content, rest = self._buf[:at], self._buf[at + len(self.MARKER) :]
        self._buf = ""
        self._calls = JsonCallsParser()
        _, deltas = self._calls.feed(rest)
        self.calls = self._calls.calls
        return content, deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._calls is None:
            rest, self._buf = self._buf, ""
            return rest, []
        return self._calls.finish()


class PythonicToolParser(ToolParser):
    """``[f(a=1), g()]``: each call is parsed with ``ast`` once it is complete. Output that
    does not open with ``[`` is content."""

    def __init__(self) -> None:
        self._buf = ""
        self._sent = 0  # calls already sent
        self._content: bool | None = None  # decided by the first non-blank character

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self._content:
            return text, []
        self._buf += text
        if self._content is None:
            head = self._buf.lstrip()
            if not head:
                return "", []
            self._content = not head.startswith("[")
            if self._content:
                out, self._buf = self._buf, ""
                return out, []
        return "", self._complete_calls()

    def _complete_calls(self) -> list[ToolCallDelta]:
        import ast

        body = self._buf.strip()
        # The longest prefix that closes into a valid list holds the calls complete so far.
        for end in range(len(body), 0, -1):
            if body[end - 1] not in ")]":
                continue
            candidate = body[:end].rstrip("]") + "]"
            try:
                tree = ast.parse(candidate, mode="eval").body
            except SyntaxError:
                continue
            if not isinstance(tree, ast.List) or not all(isinstance(c, ast.Call) for c in tree.elts):
                return []
            deltas: list[ToolCallDelta] = []
            for call in cast("list[ast.Call]", tree.elts)[self._sent :]:  # all calls: checked above
                try:
                    args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
                except ValueError:
                    return deltas
                name = ast.unparse(call.func)
                deltas.append(ToolCallDelta(self._sent, json.dumps(args, ensure_ascii=False), new_call_id(), name))
                self._sent += 1
                self.calls = self._sent
            return deltas
        return []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self._content is None:
            rest, self._buf = self._buf, ""
            return rest, []
        return "", []


TOOL_CALL_PARSERS = {
    "hermes": HermesToolParser,
    "llama3_json": lambda: JsonCallsParser("<|python_tag|>"),
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}
names.check_registry("tool-call parser", TOOL_CALL_PARSERS, names.TOOL_CALL_PARSERS)
# Without --tool-call-parser and without one reported by the tokenizer: the most common format.
DEFAULT_TOOL_CALL_PARSER = "hermes"


def forced_parser() -> ToolParser:
    """The parser of the forced (grammar-enforced) array format."""
    return JsonCallsParser()


def parse_all(parser: ToolParser, text: str) -> tuple[str, list[dict]]:
    """The whole text through ``parser``: (content, OpenAI ``tool_calls`` list)."""
    content, deltas = parser.feed(text)
    more, tail = parser.finish()
    return content + more, join_deltas(deltas + tail)


def join_deltas(deltas: list[ToolCallDelta]) -> list[dict]:
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.id is not None:
            calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
        calls[d.index]["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]
