"""The chat template the tokenizer renders with, chosen once at start.

- ``--chat-template FILE`` replaces the model's template, whatever it is.
- A model whose own template renders tools keeps it. The probe is the one ``chat.py`` makes
  per request: render a user message with a probe tool and without; the prompts differ.
- A model whose template renders no tools but speaks ChatML gets the shipped ChatML tools
  template ``ringserve/templates/chatml_tools.jinja`` (Hermes-style: the tools listed in
  the system turn, calls written as ``<tool_call>`` JSON), so that tool calling works on
  the default model (SmolLM2) without a flag. ChatML is told by its markers
  (``<|im_start|>``, ``<|im_end|>``), and the swap happens only when the shipped template
  renders plain chat exactly as the model's own does (``PLAIN_PROBES``: system prompts,
  turns, with and without a generation prompt), so nothing but tool calling changes. The
  tokenizer then reports ``hermes``, the parser of that format, as ``tool_call_parser`` in
  ``ModelInfo``, which the gateway takes as its ``--tool-call-parser`` default.
- Any other template is kept, and a request with tools gets a 400 naming ``tools``
  (``chat.py``).

Each choice is logged at start.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

import ringserve

log = logging.getLogger(__name__)

SHIPPED_TOOLS_TEMPLATE = Path(ringserve.__file__).parent / "templates" / "chatml_tools.jinja"
SHIPPED_TOOLS_PARSER = "hermes"  # services/gateway/tool_parsers.py reads the calls it teaches
CHATML_MARKERS = ("<|im_start|>", "<|im_end|>")
PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool", "description": "A probe.",
                                               "parameters": {"type": "object", "properties": {}}}}
_USER = {"role": "user", "content": "Hi"}
# (messages, add_generation_prompt): plain chat the shipped template must render as the model's does.
PLAIN_PROBES: tuple[tuple[list[dict[str, str]], bool], ...] = (
    ([_USER], True),
    ([_USER], False),
    ([{"role": "system", "content": "Be brief."}, _USER], True),
    ([_USER, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}], True),
    ([_USER, {"role": "assistant", "content": "Hello."}], False),
)


@dataclass(frozen=True)
class TemplateChoice:
    """The template the tokenizer renders with: ``template`` (None: the model's own, or none),
    ``tool_call_parser`` (the gateway parser of the calls it teaches, when the tokenizer
    knows it; "" otherwise) and ``reason`` (what the start-up log says)."""

    template: str | None
    tool_call_parser: str
    reason: str


def _render(tokenizer: Any, template: str | None, messages: list[dict], add_generation_prompt: bool,
            tools: list | None = None) -> str | None:
    """The prompt, or None when the template fails on it."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                             tokenize=False, chat_template=template)
    except (jinja2.TemplateError, ValueError, TypeError):
        return None


def renders_tools(tokenizer: Any, template: str | None = None) -> bool:
    """Whether ``template`` (None: the tokenizer's) puts the tools of a request in its prompt."""
    plain = _render(tokenizer, template, [_USER], True)
    with_tools = _render(tokenizer, template, [_USER], True, [PROBE_TOOL])
    return plain is not None and with_tools is not None and with_tools != plain


def choose_chat_template(tokenizer: Any, explicit: Path | None) -> TemplateChoice:
    """Choose the template (see the module docstring) and set it on ``tokenizer``.

    Args:
        tokenizer: a transformers tokenizer; its ``chat_template`` is replaced when the
            choice is not the model's own.
        explicit: the ``--chat-template`` file, or None.

    Raises:
        OSError: ``explicit`` cannot be read.
    """
    choice = _choose(tokenizer, explicit)
    if choice.template is not None:
        tokenizer.chat_template = choice.template
    log.info("chat template: %s", choice.reason)
    return choice


def _choose(tokenizer: Any, explicit: Path | None) -> TemplateChoice:
    if explicit is not None:
        return TemplateChoice(explicit.read_text(), "", f"{explicit} (--chat-template)")
    own = tokenizer.chat_template
    if not own:
        return TemplateChoice(None, "", "none: the model has none (chat requests get a 400; give --chat-template)")
    if renders_tools(tokenizer):
        return TemplateChoice(None, "", "the model's own (it renders tools)")
    if not isinstance(own, str) or not all(marker in own for marker in CHATML_MARKERS):
        return TemplateChoice(None, "", "the model's own, which renders no tools and is not ChatML: requests with "
                                        "tools get a 400 (give --chat-template FILE to call tools)")
    shipped = SHIPPED_TOOLS_TEMPLATE.read_text()
    differs = [i for i, (messages, gen) in enumerate(PLAIN_PROBES)
               if _render(tokenizer, shipped, messages, gen) != _render(tokenizer, None, messages, gen)]
    if differs:
        return TemplateChoice(None, "", "the model's own, which renders no tools; the shipped "
                                        f"{SHIPPED_TOOLS_TEMPLATE.name} renders plain chat differently (probe "
                                        f"{differs[0]}), so requests with tools get a 400 (give --chat-template FILE "
                                        "to call tools)")
    return TemplateChoice(shipped, SHIPPED_TOOLS_PARSER,
                          f"{SHIPPED_TOOLS_TEMPLATE} (the model's own ChatML template renders no tools; this one "
                          f"renders plain chat the same and tools too; tool calls are {SHIPPED_TOOLS_PARSER} format)")
