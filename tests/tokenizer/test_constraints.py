"""Constraints checked and resolved in the tokenizer; tools refused on a template that drops them."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from ringserve.v1 import common_pb2, tokenizer_pb2
from services.tokenizer.chat import render_chat
from services.tokenizer.constraints import choice_grammar, gate_reasoning, resolve_constraint
from services.tokenizer.errors import RequestError
from services.tokenizer.regex_repeats import max_repeat
from services.tokenizer.sampling import resolve_sampling_params

TEMPLATE = Path(__file__).resolve().parents[2] / "ringserve" / "templates" / "chatml_tools.jinja"
TOOLS = json.dumps([{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}])


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


def refused(c: common_pb2.Constraint) -> RequestError:
    with pytest.raises(RequestError) as info:
        resolve_constraint(c)
    assert info.value.status == grpc.StatusCode.INVALID_ARGUMENT
    return info.value


def test_json_object_and_choice_become_what_the_scheduler_compiles():
    out = resolve_constraint(common_pb2.Constraint(json_object=True, param="response_format"))
    assert (out.WhichOneof("kind"), out.json_schema, out.param) == ("json_schema", '{"type": "object"}',
                                                                     "response_format")
    c = common_pb2.Constraint(param="structured_outputs.choice")
    c.choice.choices.extend(['say "hi"', "a\\b", "line\nbreak"])
    out = resolve_constraint(c)
    assert out.ebnf == 'root ::= "say \\"hi\\"" | "a\\\\b" | "line\\x0Abreak"'
    assert out.ebnf == choice_grammar(['say "hi"', "a\\b", "line\nbreak"])
    assert resolve_constraint(common_pb2.Constraint(json_schema="true")).json_schema == "{}"


@pytest.mark.parametrize("constraint,message", [
    (common_pb2.Constraint(json_schema='{"type": "object", "properties": 5}', param="response_format"),
     "response_format: not a valid JSON Schema at properties: 5 is not of type 'object'"),
    (common_pb2.Constraint(json_schema="{", param="response_format"),
     "response_format: the JSON schema is not valid JSON"),
    (common_pb2.Constraint(json_schema="[1]", param="structured_outputs.json"),
     "structured_outputs.json: a JSON schema must be an object (or true), got list"),
    (common_pb2.Constraint(regex="", param="regex"), "regex: the regex is empty"),
    (common_pb2.Constraint(choice=common_pb2.ChoiceList(), param="structured_outputs.choice"),
     "structured_outputs.choice: the choice list is empty"),
    (common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=["a", ""]), param="structured_outputs.choice"),
     "structured_outputs.choice: a choice is an empty string"),
    (common_pb2.Constraint(json_schema=json.dumps({"type": "object", "default": nested(40)}), param="response_format"),
     "response_format: nests deeper than 32 levels of objects and arrays"),
    (common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=[f"c{i}" for i in range(1001)]),
                           param="structured_outputs.choice"),
     "structured_outputs.choice: 1001 choices; at most 1000 are supported"),
    (common_pb2.Constraint(regex="a{300000}", param="structured_outputs.regex"),
     "structured_outputs.regex: the regex counts to 300000 (nested repetitions multiplied); at most 1000 is supported"),
    (common_pb2.Constraint(regex="(x(ab){50}){21}", param="regex"), "regex: the regex counts to 1050 "),
    (common_pb2.Constraint(json_schema=json.dumps({"type": "string", "pattern": "^[0-9]{1001}$"}),
                           param="response_format"),
     "response_format: the schema pattern '^[0-9]{1001}$' counts to 1001 "),
    (common_pb2.Constraint(json_schema=json.dumps({"type": "object", "properties": {"const": {
        "type": "object", "patternProperties": {"k{2000}": {}}}}}), param="response_format"),
     "response_format: the schema pattern 'k{2000}' counts to 2000 "),
])
def test_bad_constraints_are_refused_naming_the_field(constraint, message):
    error = refused(constraint)
    assert error.message.startswith(message), error.message
    assert error.param == constraint.param


def test_limits_are_inclusive_and_data_is_not_a_pattern():
    choices = common_pb2.Constraint(choice=common_pb2.ChoiceList(choices=[f"c{i}" for i in range(1000)]))
    assert resolve_constraint(choices).ebnf.count(" | ") == 999
    assert resolve_constraint(common_pb2.Constraint(regex="(ab){10}[0-9]{100}|z{1000}")).regex
    schema = {"type": "object", "properties": {"pattern": {"type": "string", "pattern": "[a-z]{1000}"}},
              "examples": [{"pattern": "a{5000}"}]}  # examples are data
    assert resolve_constraint(common_pb2.Constraint(json_schema=json.dumps(schema))).json_schema


@pytest.mark.parametrize("regex,count", [
    ("abc", 1), ("a{2,5}", 5), ("a{7,}", 7), ("a{3}{4}", 12), ("(a{100}){100}", 10000), ("((ab){10}c){20}", 200),
    ("(?:x{3}){4}|y{50}", 50), ("[a{5000}]", 1), (r"\{5000}", 1), (r"\p{L}{3}", 3), ("[[:alpha:]]{9}", 9),
    ("(a{1000}", 1000), ("x{0}", 1), (r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)", 3),
])
def test_max_repeat_multiplies_nested_counts_and_skips_escapes_and_classes(regex, count):
    assert max_repeat(regex) == count


def test_the_prompt_opens_the_reasoning_only_when_it_ends_with_the_tag():
    def encode(text: str) -> list[int]:
        return [ord(ch) for ch in text]

    def gated(prompt: str, start: str = "<think>") -> tuple[bool, common_pb2.Constraint]:
        params = common_pb2.ResolvedSamplingParams(constraint=common_pb2.Constraint(
            regex="[0-9]+", starts_after="</think>", opens_with="<think>"))
        return gate_reasoning(params, prompt, start, encode), params.constraint

    opened, c = gated("<|im_start|>assistant\n<think>\n")
    assert opened and (c.opens_with, list(c.opens_with_ids), list(c.starts_after_ids)) == ("", [], encode("</think>"))
    for prompt, start in (("<|im_start|>assistant\n", "<think>"), ("<think>x</think>\n", "<think>"),
                          ("a <think>", ""), (None, "<think>")):
        opened, c = gated(prompt, start)
        assert not opened and list(c.opens_with_ids) == encode("<think>"), prompt
    plain = common_pb2.ResolvedSamplingParams()
    assert gate_reasoning(plain, "x<think>", "<think>", encode) and not plain.HasField("constraint")


def test_min_tokens_cannot_be_combined_with_a_constraint():
    sp = common_pb2.SamplingParams(min_new_tokens=3, constraint=common_pb2.Constraint(regex="a+", param="regex"))
    with pytest.raises(RequestError) as info:
        resolve_sampling_params(sp, 5, 2048, 49152)
    assert (info.value.param, info.value.message) == ("min_tokens", "min_tokens cannot be combined with regex")


def test_tools_on_a_template_that_drops_them_are_refused(smollm2_tokenizer):
    chat = tokenizer_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="user", content="Time?")],
                                   tools_json=TOOLS)
    with pytest.raises(RequestError) as info:
        render_chat(smollm2_tokenizer, chat)
    assert info.value.param == "tools"
    assert "this model's chat template does not render tools" in info.value.message
    assert "--chat-template" in info.value.message


def test_the_shipped_template_renders_tools_and_plain_chat_like_smollm2s(smollm2_tokenizer):
    import copy

    tok = copy.copy(smollm2_tokenizer)
    plain = tokenizer_pb2.ChatInput(messages=[tokenizer_pb2.ChatMessage(role="user", content="Time?")])
    before = render_chat(smollm2_tokenizer, plain)
    tok.chat_template = TEMPLATE.read_text()
    assert render_chat(tok, plain) == before
    with_tools = tokenizer_pb2.ChatInput(messages=plain.messages, tools_json=TOOLS)
    prompt = render_chat(tok, with_tools)
    tools = '{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}'
    assert f"<tools>\n{tools}\n</tools>" in prompt
    assert prompt.endswith("<|im_start|>user\nTime?<|im_end|>\n<|im_start|>assistant\n")
