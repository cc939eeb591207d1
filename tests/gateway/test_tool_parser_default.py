"""Which tool-call parser reads a chat's calls under tool_choice auto: ``--tool-call-parser``
when given, else the one the tokenizer reports for the chat template it chose
(``ModelInfo.tool_call_parser``), else hermes."""

from __future__ import annotations

import pytest

from services.gateway.chat_output import final_message, parser_factory, tool_call_parser_name
from services.gateway.config import GatewayConfig
from services.gateway.protocol import ChatCompletionRequest

TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
HERMES = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
MISTRAL = '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]'


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "Time?"}],
                                                 "tools": [TOOL], **kw})


@pytest.mark.parametrize("flag,reported,used", [
    (None, "", "hermes"),
    (None, "hermes", "hermes"),
    (None, "mistral", "mistral"),
    ("pythonic", "hermes", "pythonic"),
    ("none", "hermes", "none"),
])
def test_the_flag_wins_then_the_tokenizers_report_then_hermes(flag, reported, used):
    assert tool_call_parser_name(GatewayConfig(tool_call_parser=flag), reported) == used


def test_the_reported_parser_reads_the_calls():
    def calls(text: str, config: GatewayConfig, reported: str) -> tuple:
        make = parser_factory(request(), config, reported)
        assert make is not None
        fields = final_message(make(False), text)
        return fields["content"], [(c["function"]["name"], c["function"]["arguments"]) for c in fields["tool_calls"]
                                   or ()]

    assert calls(MISTRAL, GatewayConfig(), "mistral") == (None, [("get_time", "{}")])
    assert calls(HERMES, GatewayConfig(), "") == (None, [("get_time", "{}")])
    assert calls(HERMES, GatewayConfig(tool_call_parser="mistral"), "hermes") == (HERMES, [])
    assert parser_factory(request(), GatewayConfig(tool_call_parser="none"), "hermes") is None
    assert parser_factory(request(tool_choice="none"), GatewayConfig(), "hermes") is None
