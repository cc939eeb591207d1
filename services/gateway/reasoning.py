"""Model output text -> (reasoning_content, content), incrementally (one parser per choice).

``--reasoning-parser`` (the text inside ``<think>…</think>`` is reasoning):

- ``qwen3``: reasoning only when the output opens with ``<think>`` (after blanks); Qwen3
  with ``enable_thinking: false`` has an empty think block in the prompt and answers directly.
- ``deepseek_r1``: as qwen3, and also when the rendered prompt ends with ``<think>``
  (DeepSeek-R1's template opens the block in the generation prompt): then everything up to
  ``</think>`` is reasoning. The tokenizer, which renders the prompt, says so on each output
  (``GenerateOutput.reasoning_open``).

With ``chat_template_kwargs.enable_thinking`` false nothing is reasoning. The scheduler's
grammar gate (services/scheduler/policy/grammar_gate.py) decides by the same rule where an
output constraint starts, so text the grammar shaped is always content.

Tags split across chunks are held back until they are whole, so no delta and no final
field ever holds ``<think>``, ``</think>`` or a piece of one; output cut off (max_tokens)
inside the reasoning stays reasoning. The non-streamed response feeds the whole text once
through the same code, so streamed deltas joined equal the non-streamed fields. A tool
call written inside the reasoning is reasoning text, not a call (the chat parsers look for
calls only in the content after it).
"""

from __future__ import annotations

from ringserve.options import names

from .tool_parsers import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


class ReasoningParser:
    """States: "start" (may still see <think>), "reasoning", "content"."""

    def __init__(self, implicit_open: bool, thinking: bool = True):
        self._implicit_open = implicit_open
        self._state = "start" if thinking else "content"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """-> (reasoning delta, content delta)."""
        self._buf += text
        reasoning, content = "", ""
        if self._state == "start":
            head = self._buf.lstrip()
            if len(head) < len(OPEN) and OPEN.startswith(head):
                return "", ""  # could still become <think>
            if head.startswith(OPEN):
                self._buf = head[len(OPEN) :]
                self._state = "reasoning"
            else:
                self._state = "reasoning" if self._implicit_open else "content"
        if self._state == "reasoning":
            at = self._buf.find(CLOSE)
            if at < 0:
                keep = partial_suffix(self._buf, CLOSE)
                reasoning, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
                return reasoning, ""
            reasoning, self._buf = self._buf[:at], self._buf[at + len(CLOSE) :]
            self._state = "content"
        content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: a partial tag at the end of reasoning stays reasoning."""
        rest, self._buf = self._buf, ""
        if self._state == "content" or (self._state == "start" and not self._implicit_open):
            return "", rest
        return rest, ""


REASONING_PARSERS = {"deepseek_r1": True, "qwen3": False}  # name -> the prompt may open the reasoning
names.check_registry("reasoning parser", REASONING_PARSERS, names.REASONING_PARSERS)


def make_reasoning_parser(name: str, chat_template_kwargs: dict | None, prompt_opened: bool) -> ReasoningParser:
    """The parser ``name`` for one choice; thinking is off when the request says so.
    ``prompt_opened``: the rendered prompt ends with the opening tag (GenerateOutput.reasoning_open)."""
    thinking = (chat_template_kwargs or {}).get("enable_thinking", True) is not False
    return ReasoningParser(REASONING_PARSERS[name] and prompt_opened, thinking)
