"""The chat template chosen at start: a ChatML model whose template renders no tools gets the
shipped tools template (and reports the hermes parser) only where it renders plain chat the
same; a template that renders tools, any other template and ``--chat-template`` are kept."""

from __future__ import annotations

import copy
import logging

import pytest

from ringserve.v1 import tokenizer_pb2
from services.tokenizer.chat import render_chat
from services.tokenizer.chat_template import SHIPPED_TOOLS_TEMPLATE, choose_chat_template, renders_tools
from services.tokenizer.model import model_facts

CHATML_NO_SYSTEM = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
PLAIN = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
WITH_TOOLS = PLAIN + "{% if tools %}[tools] {{ tools | tojson }}{% endif %}"
TOOLS = '[{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]'


@pytest.fixture
def tok(smollm2_tokenizer):
    return copy.copy(smollm2_tokenizer)


def test_smollm2_gets_the_shipped_template_which_renders_its_plain_chat_unchanged(tok, smollm2_dir, caplog):
    plain = tokenizer_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="user", content="Time?")])
    before = render_chat(tok, plain)
    assert not renders_tools(tok)
    with caplog.at_level(logging.INFO, logger="services.tokenizer.chat_template"):
        choice = choose_chat_template(tok, None)
    assert (choice.template, choice.tool_call_parser) == (SHIPPED_TOOLS_TEMPLATE.read_text(), "hermes")
    assert tok.chat_template == choice.template and renders_tools(tok)
    assert caplog.messages == [f"chat template: {SHIPPED_TOOLS_TEMPLATE} (the model's own ChatML template renders "
                               "no tools; this one renders plain chat the same and tools too; tool calls are hermes "
                               "format)"]
    assert render_chat(tok, plain) == before
    prompt = render_chat(tok, tokenizer_pb2.ChatInput(messages=plain.messages, tools_json=TOOLS))
    assert '<tools>\n{"type": "function", "function": {"name": "get_time"' in prompt
    assert model_facts(smollm2_dir, tok, tool_call_parser=choice.tool_call_parser).tool_call_parser == "hermes"


@pytest.mark.parametrize("template,reason", [
    (WITH_TOOLS, "the model's own (it renders tools)"),
    (PLAIN, "the model's own, which renders no tools and is not ChatML: requests with tools get a 400 (give "
            "--chat-template FILE to call tools)"),
    (CHATML_NO_SYSTEM, "the model's own, which renders no tools; the shipped chatml_tools.jinja renders plain chat "
                       "differently (probe 0), so requests with tools get a 400 (give --chat-template FILE to call "
                       "tools)"),
    (None, "none: the model has none (chat requests get a 400; give --chat-template)"),
])
def test_any_other_template_is_kept(tok, template, reason):
    tok.chat_template = template
    choice = choose_chat_template(tok, None)
    assert (choice.template, choice.tool_call_parser, choice.reason) == (None, "", reason)
    assert tok.chat_template == template


def test_an_explicit_template_wins_and_reports_no_parser(tok, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(WITH_TOOLS)
    choice = choose_chat_template(tok, path)
    assert (tok.chat_template, choice.tool_call_parser, choice.reason) == (WITH_TOOLS, "", f"{path} (--chat-template)")
