"""Tool-call and reasoning parsers over recorded outputs, cut at every chunk boundary: the
joined deltas equal the whole-text parse, no tag or piece of one leaks into any field."""

from __future__ import annotations

import json

import pytest

from services.gateway.chat_output import ChoiceParser, final_message
from services.gateway.reasoning import make_reasoning_parser
from services.gateway.tool_parsers import TOOL_CALL_PARSERS, ToolCallDelta, forced_parser, join_deltas

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
          '</tool_call>\n<tool_call>\n{"name": "book_trip", "arguments": {"city": "Rome", "dates": {"from": '
          '"May 3", "nights": 2}}}\n</tool_call>')
LLAMA3 = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "days": 10}}; '
          '{"name": "get_time", "parameters": {}}')
FORCED = ('[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},\n {"name": "get_weather", '
          '"arguments": {"city": "Rome \\"old\\" town", "days": 1}}, {"name": "get_time", "arguments": {}}]')
MISTRAL = ('Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}, '
           '{"name": "get_time", "arguments": {}}]')
PYTHONIC = '[get_weather(city="Paris", days=3), book_trip(city="Rome (old)", dates={"nights": 2}), get_time()]'
EXPECTED = {
    "hermes": ("Let me check.\n\n", [("get_weather", '{"city": "Paris", "days": 3}'),
                                     ("book_trip", '{"city": "Rome", "dates": {"from": "May 3", "nights": 2}}')]),
    "llama3_json": ("", [("get_weather", '{"city": "Oslo", "days": 10}'), ("get_time", "{}")]),
    "mistral": ("Checking. ", [("get_weather", '{"city": "Oslo", "days": 2}'), ("get_time", "{}")]),
    "pythonic": ("", [("get_weather", '{"city": "Paris", "days": 3}'),
                      ("book_trip", '{"city": "Rome (old)", "dates": {"nights": 2}}'), ("get_time", "{}")]),
    "forced": ("", [("get_weather", '{"city": "Paris", "days": 3}'),
                    ("get_weather", '{"city": "Rome \\"old\\" town", "days": 1}'), ("get_time", "{}")]),
}
TEXTS = {"hermes": HERMES, "llama3_json": LLAMA3, "mistral": MISTRAL, "pythonic": PYTHONIC, "forced": FORCED}


def make(name: str):
    return forced_parser() if name == "forced" else TOOL_CALL_PARSERS[name]()


def run(name: str, chunks: list[str]) -> tuple[str, list[ToolCallDelta]]:
    parser = make(name)
    content, deltas = "", []
    for chunk in chunks:
        c, d = parser.feed(chunk)
        content += c
        deltas += d
    c, d = parser.finish()
    return content + c, deltas + d


def calls_of(deltas: list[ToolCallDelta]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in join_deltas(deltas)]


@pytest.mark.parametrize("name", list(TEXTS))
def test_every_two_chunk_split_gives_the_whole_text_parse(name):
    text = TEXTS[name]
    content, calls = EXPECTED[name]
    for cut in range(len(text) + 1):
        got_content, deltas = run(name, [text[:cut], text[cut:]])
        assert (got_content, calls_of(deltas)) == (content, calls), cut
        for d in deltas:  # the first delta of each call names it; later ones only carry arguments
            assert (d.id is None) == (d.name is None)
        assert len({d.id for d in deltas if d.id}) == len(calls)


@pytest.mark.parametrize("name", list(TEXTS))
def test_one_character_chunks(name):
    content, deltas = run(name, list(TEXTS[name]))
    assert (content, calls_of(deltas)) == EXPECTED[name]
    for _, arguments in calls_of(deltas):
        json.loads(arguments)


def test_text_without_calls_is_all_content_and_a_partial_marker_is_flushed():
    assert run("hermes", ["Plain answer <tool", "_ca"]) == ("Plain answer <tool_ca", [])
    assert run("hermes", ["a < b and <b>bold</b>"]) == ("a < b and <b>bold</b>", [])
    assert run("mistral", ["Plain [TOOL", "_CA"]) == ("Plain [TOOL_CA", [])
    assert run("hermes", ["Hi <tool_call>\n{not json"]) == ("Hi <tool_call>\n{not json", [])
    assert run("pythonic", ["  Plain (", "answer)"]) == ("  Plain (answer)", [])


@pytest.mark.parametrize("name", ["llama3_json", "forced"])
def test_json_call_formats_never_drop_text(name):
    for text in ("Plain answer, no call.", "  {not a call}", '[{"na', '<|python_tag|>{"arguments": {}}'):
        for cut in range(len(text) + 1):
            assert run(name, [text[:cut], text[cut:]]) == (text, []), (text, cut)
    # Once a call is named, the text around the objects is the format's punctuation.
    content, deltas = run(name, ['[{"name": "f", "arguments": {}}, {"na'])
    assert (content, calls_of(deltas)) == ("", [("f", "{}")])


THINK = "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is 4."


@pytest.mark.parametrize("name,prompt_opened,text,reasoning,content", [
    ("deepseek_r1", False, THINK, "\nThe user asks 2+2. That is 4.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", True, THINK, "\nThe user asks 2+2. That is 4.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", True, THINK.removeprefix("<think>"), "\nThe user asks 2+2. That is 4.\n", "\n\nThe answer is 4."),
    ("deepseek_r1", False, "The answer is 4.", "", "The answer is 4."),
    ("qwen3", False, THINK, "\nThe user asks 2+2. That is 4.\n", "\n\nThe answer is 4."),
    ("qwen3", False, "The answer is 4.", "", "The answer is 4."),
    ("qwen3", True, "The answer is 4.", "", "The answer is 4."),  # qwen3 reads only the output
    ("deepseek_r1", True, "cut off by max_tok", "cut off by max_tok", ""),
    ("deepseek_r1", False, "<think>cut off at </thi", "cut off at </thi", ""),
])
def test_reasoning_split_at_every_boundary(name, prompt_opened, text, reasoning, content):
    for cut in range(len(text) + 1):
        for chunks in ([text[:cut], text[cut:]], list(text)):
            parser = make_reasoning_parser(name, None, prompt_opened)
            r, c = "", ""
            for chunk in chunks:
                dr, dc = parser.feed(chunk)
                for part in (dr, dc):
                    assert "<think>" not in part and "</think>" not in part
                r, c = r + dr, c + dc
            dr, dc = parser.finish()
            assert (r + dr, c + dc) == (reasoning, content), (cut, chunks)


def test_enable_thinking_false_leaves_everything_in_content():
    parser = make_reasoning_parser("deepseek_r1", {"enable_thinking": False}, True)
    assert parser.feed("The answer is 4.") == ("", "The answer is 4.")


def test_reasoning_then_tool_calls_in_one_message():
    text = "<think>I should call the tool.</think>" + HERMES
    parser = ChoiceParser(make_reasoning_parser("qwen3", None, False), TOOL_CALL_PARSERS["hermes"]())
    message = final_message(parser, text)
    assert message["reasoning_content"] == "I should call the tool."
    assert message["content"] == "Let me check.\n\n"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == EXPECTED["hermes"][1]


def test_parallel_tool_calls_false_keeps_only_the_first_call():
    parser = ChoiceParser(None, TOOL_CALL_PARSERS["hermes"](), parallel=False)
    message = final_message(parser, HERMES)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
        EXPECTED["hermes"][1][:1]
