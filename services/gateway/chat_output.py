"""One chat choice's text -> reasoning_content, content and tool_calls, streamed or whole.

Which parsers apply is decided per request: reasoning (``--reasoning-parser``, unless
the request turns thinking off), then tool calls: the forced array format when
``tool_choice`` is "required" or a named function, the model's own format
(``--tool-call-parser``, by default the tokenizer's report) when tools are offered under
"auto", none otherwise. The
non-streamed message goes through the same incremental parsers in one feed, so the
streamed deltas joined equal it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ringserve.v1 import tokenizer_pb2

from .backend import TokenizerClient
from .config import GatewayConfig
from .constraints import forced_tools
from .protocol import ChatCompletionRequest
from .reasoning import CLOSE as REASONING_END
from .reasoning import OPEN as REASONING_START
from .reasoning import REASONING_PARSERS, ReasoningParser, make_reasoning_parser
from .tool_parsers import (
    DEFAULT_TOOL_CALL_PARSER,
    TOOL_CALL_PARSERS,
    ToolCallDelta,
    ToolParser,
    forced_parser,
    join_deltas,
)


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ChoiceParser:
    """reasoning -> tool calls -> content, for one choice."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, parallel: bool = True):
        self.reasoning = reasoning
        self.tools = tools
        self.parallel = parallel  # false: calls after the first are dropped (parallel_tool_calls)
        self.made_calls = False  # a call was sent (it has a name): a started, nameless one is none

    def _split(self, reasoning: str, content: str, final: bool) -> ChoiceDelta:
        if self.tools is None:
            return ChoiceDelta(reasoning, content)
        text, calls = self.tools.feed(content)
        if final:
            more, tail = self.tools.finish()
            text, calls = text + more, calls + tail
        if not self.parallel:
            calls = [d for d in calls if d.index == 0]
        self.made_calls = self.made_calls or any(d.id is not None for d in calls)
        return ChoiceDelta(reasoning, text, calls)

    def feed(self, text: str, final: bool = False) -> ChoiceDelta:
        reasoning, content = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        if final and self.reasoning is not None:
            r2, c2 = self.reasoning.finish()
            reasoning, content = reasoning + r2, content + c2
        return self._split(reasoning, content, final)


def mark_reasoning(pb: tokenizer_pb2.GenerateReqInput, req: ChatCompletionRequest, config: GatewayConfig) -> None:
    """Tell the tokenizer and the scheduler where a thinking request's reasoning may be, so
    that they split the output as the reasoning parser will: an output constraint starts at
    once unless the output opens with ``<think>`` (then after ``</think>``); under a parser
    whose prompt may open the reasoning (deepseek_r1), the tokenizer checks the rendered
    prompt's end for the tag too (and a grammar then waits for ``</think>``)."""
    if config.reasoning_parser is None or (req.chat_template_kwargs or {}).get("enable_thinking", True) is False:
        return
    if pb.sampling_params.HasField("constraint"):
        c = pb.sampling_params.constraint
        c.opens_with, c.starts_after = REASONING_START, REASONING_END
    if REASONING_PARSERS[config.reasoning_parser]:
        pb.chat.reasoning_start = REASONING_START


def tool_call_parser_name(config: GatewayConfig, reported: str = "") -> str:
    """The tool-call parser in use: ``--tool-call-parser`` when given, else the one the
    tokenizer reports for the chat template it chose (``ModelInfo.tool_call_parser``), else
    ``DEFAULT_TOOL_CALL_PARSER``."""
    return config.tool_call_parser or reported or DEFAULT_TOOL_CALL_PARSER


async def reported_parser_factory(client: TokenizerClient, req: ChatCompletionRequest,
                                  config: GatewayConfig) -> Callable[[bool], ChoiceParser] | None:
    """``parser_factory`` with the parser the tokenizer reports for its chat template, asked
    for only when ``req`` has tools and no ``--tool-call-parser`` names one."""
    reported = (await client.model_card()).info.tool_call_parser if req.tools and not config.tool_call_parser else ""
    return parser_factory(req, config, reported)


def parser_factory(req: ChatCompletionRequest, config: GatewayConfig,
                   reported_parser: str = "") -> Callable[[bool], ChoiceParser] | None:
    """A maker of per-choice parsers for ``req``, or None when its text is plain content; it
    takes whether the prompt opened the reasoning (``GenerateOutput.reasoning_open``).
    ``reported_parser``: the tokenizer's ``ModelInfo.tool_call_parser`` (see
    ``tool_call_parser_name``).

    An output constraint on a thinking request applies where the reasoning parser sees no
    reasoning (``mark_reasoning``).
    """
    reasoning = config.reasoning_parser
    name = tool_call_parser_name(config, reported_parser)
    if forced_tools(req) is not None:
        tools: Callable[[], ToolParser] | None = forced_parser
    elif req.tools and req.tool_choice != "none" and name != "none":
        tools = TOOL_CALL_PARSERS[name]
    else:
        tools = None
    if reasoning is None and tools is None:
        return None
    kwargs = req.chat_template_kwargs
    parallel = req.parallel_tool_calls is not False  # the forced format enforces it in the grammar too

    def make(prompt_opened: bool) -> ChoiceParser:
        return ChoiceParser(make_reasoning_parser(reasoning, kwargs, prompt_opened) if reasoning else None,
                            tools() if tools else None, parallel)

    return make


def delta_calls(calls: list[ToolCallDelta]) -> list[dict]:
    """Tool-call deltas as chunk entries: the first of a call has id, type and name."""
    out = []
    for d in calls:
        if d.id is not None:
            out.append({"index": d.index, "id": d.id, "type": "function",
                        "function": {"name": d.name, "arguments": d.arguments}})
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out


def final_message(parser: ChoiceParser, text: str) -> dict:
    """The non-streamed message fields of a choice's whole text."""
    d = parser.feed(text, final=True)
    calls = join_deltas(d.calls)
    message = {"content": d.content or None if calls else d.content, "tool_calls": calls or None}
    if parser.reasoning is not None:
        message["reasoning_content"] = d.reasoning or None
    return message


def finish_reason(parser: ChoiceParser | None, reason: str | None) -> str | None:
    """"tool_calls" when the choice stopped having made calls (OpenAI), else the engine's
    reason: output cut by the length limit is "length", calls or not (OpenAI's too), and its
    calls carry their arguments as far as they were written."""
    if reason == "stop" and parser is not None and parser.made_calls:
        return "tool_calls"
    return reason
