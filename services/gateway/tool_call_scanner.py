"""One tool call's JSON object, scanned as it arrives: the piece every JSON tool-call format shares.

``CallScanner`` tracks strings, escapes and depth over the text seen so far and notes
where the top-level keys' values start and end, so that a call's name is known as soon as
it is complete and its ``arguments`` can be streamed as they are written (exactly as the
model wrote them: the streamed fragments joined equal the whole). ``ToolCallDelta`` is one
such piece as the parsers hand it on.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


@dataclass
class ToolCallDelta:
    index: int
    arguments: str = ""
    id: str | None = None  # set on the first delta of a call, with name
    name: str | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallScanner:
    """One JSON object ``{"name": "...", "arguments": <value>}`` arriving piece by piece.

    Tracks strings, escapes and depth over the text seen so far, and notes where the top
    level keys' values start and end. ``parameters`` is taken as ``arguments`` (Llama 3).
    """

    def __init__(self, index: int):
        self.index = index
        self.text = ""
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.end: int | None = None  # one past the closing brace, once the object is complete
        self.header_sent = False
        self.args_sent = 0
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._key: str | None = None
        self._key_start = 0
        self._value_key: str | None = None  # the key whose value is being read at depth 1
        self._value_start: int | None = None
        self._expect_key = True

    def feed(self, text: str) -> list[ToolCallDelta]:
        self.text += text
        self._scan()
        return self._deltas()

    def _scan(self) -> None:
        t = self.text
        while self._pos < len(t) and self.end is None:
            i, ch = self._pos, t[self._pos]
            self._pos += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 1 and self._expect_key:
                        self._key = json.loads(t[self._key_start : i + 1])
                    elif self._depth == 1 and self._value_start is not None:
                        self._end_value(i + 1)
                continue
            if ch == '"':
                self._in_string = True
                if self._depth == 1 and self._expect_key:
                    self._key_start = i
                elif self._depth == 1 and self._value_start is None:
                    self._value_start = i
            elif ch in "{[":
                if self._depth == 1 and self._value_start is None and not self._expect_key:
                    self._value_start = i
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 1 and self._value_start is not None:
                    self._end_value(i + 1)
                elif self._depth == 0:
                    if self._value_start is not None:
                        self._end_value(i)
                    self.end = i + 1
            elif self._depth == 1:
                if ch == ":":
                    self._expect_key = False
                    self._value_key = self._key
                    self._value_start = None
                elif ch == ",":
                    if self._value_start is not None:
                        self._end_value(i)
                    self._expect_key = True
                elif not ch.isspace() and self._value_start is None and not self._expect_key:
                    self._value_start = i  # a number, true, false or null

    def _end_value(self, end: int) -> None:
        start, key = self._value_start, self._value_key
        self._value_start = self._value_key = None
        if start is None:
            return
        raw = self.text[start:end].strip()
        if key == "name" and self.name is None:
            try:
                name = json.loads(raw)
            except json.JSONDecodeError:
                return
            self.name = name if isinstance(name, str) else None
        elif key in ("arguments", "parameters") and self.args_end is None:
            self.args_start, self.args_end = start, start + len(raw)

    def _args_available(self) -> str:
        if self.args_start is None:
            if self._value_key in ("arguments", "parameters") and self._value_start is not None:
                return self.text[self._value_start :]
            return ""
        return self.text[self.args_start : self.args_end]

    def _deltas(self) -> list[ToolCallDelta]:
        if self.name is None:
            return []
        out = []
        if not self.header_sent:
            self.header_sent = True
            out.append(ToolCallDelta(self.index, id=new_call_id(), name=self.name))
        args = self._args_available()
        if self.args_start is None and self._value_start is not None:
            args = args.rstrip()  # trailing blanks of a value still arriving may not be its own
        if len(args) > self.args_sent:
            fragment = args[self.args_sent :]
            self.args_sent = len(args)
            if out:
                out[0].arguments = fragment
            else:
                out.append(ToolCallDelta(self.index, arguments=fragment))
        return out

    def finish(self) -> list[ToolCallDelta]:
        """At the end of the output: a call without arguments gets ``{}``."""
        out = self._deltas()
        if self.name is not None and self.args_sent == 0 and self.end is not None:
            out.append(ToolCallDelta(self.index, arguments="{}"))
            self.args_sent = 2
        return out
