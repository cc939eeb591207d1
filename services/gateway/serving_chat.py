"""``POST /v1/chat/completions``: one chat.completion body or a chat.completion.chunk stream.

Stream shape (OpenAI; cases C06 and C07): every chunk has the same id, created and model;
the first delta of each choice carries ``role: "assistant"``; every choice has a
``finish_reason`` key, null until its last chunk; content chunks have ``usage: null``; with
``stream_options.include_usage`` one more chunk with ``choices: []`` and the usage of the
whole request follows the finish chunks; then ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from . import convert
from .backend import TokenizerClient
from .chat_output import (
    ChoiceParser,
    delta_calls,
    final_message,
    finish_reason,
    mark_reasoning,
    reported_parser_factory,
)
from .config import GatewayConfig
from .logprobs import chat_logprobs, vllm_prompt_logprobs
from .outputs import ChoiceUpdate, FinalChoice
from .protocol import ChatCompletionRequest
from .serving import respond, response_head


def _delta_choice(
    client: TokenizerClient, echo: str, want_logprobs: bool, make_parser: Callable[[bool], ChoiceParser] | None
) -> Callable[[ChoiceUpdate], Awaitable[dict | None]]:
    """Chunk choices: the first delta of a choice carries the role (and the echo); with
    parsers, reasoning_content and tool_calls deltas beside the content."""
    parsers: dict[int, ChoiceParser] = {}

    async def choice_of(u: ChoiceUpdate) -> dict | None:
        parser = None
        extra: dict[str, Any]
        if make_parser is None:
            text, extra = u.text, {}
        else:
            parser = parsers.get(u.index)
            if parser is None:
                parser = parsers[u.index] = make_parser(u.out.reasoning_open)
            d = parser.feed(u.text, final=u.finish_reason is not None)
            text, extra = d.content, {}
            if d.reasoning:
                extra["reasoning_content"] = d.reasoning
            if d.calls:
                extra["tool_calls"] = delta_calls(d.calls)
        delta: dict = {}
        if u.first:
            delta = {"role": "assistant", "content": echo + text, **extra}
        elif text or extra:
            delta = {"content": text, **extra} if text else extra
        elif u.finish_reason is None and not (want_logprobs and u.out.output_ids):
            return None
        return {
            "index": u.index,
            "delta": delta,
            "logprobs": await chat_logprobs(client, u.out) if want_logprobs else None,
            "finish_reason": finish_reason(parser, u.finish_reason),
            "matched_stop": u.matched_stop,
        }

    return choice_of


def _echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the final assistant message being continued, else nothing."""
    last = req.messages[-1]
    if not req.echo or last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "".join(p.text or "" for p in last.content)


async def create_chat_completion(
    client: TokenizerClient, request: Request, req: ChatCompletionRequest, config: GatewayConfig
) -> Response:
    """Serve one chat request; every error before the first output is a JSON error.

    Raises:
        GatewayError: validation (400), unknown model (404), tokenizer errors (mapped).
        ClientDisconnected: the client went away before the response started.
    """
    rid = convert.new_rid(req)
    pb = convert.chat_request(req, rid)
    mark_reasoning(pb, req, config)
    make_parser = await reported_parser_factory(client, req, config)
    model, pb.lora_name = await client.resolve_model(req.model)
    echo = _echo_text(req)

    async def prompt_logprobs(finals: list[FinalChoice]) -> dict:
        # vLLM's chat response: the rendered prompt's logprobs, once, at the top level.
        return {"prompt_logprobs": await vllm_prompt_logprobs(client, finals[0].out) if finals else None}

    async def final_choice(c: FinalChoice) -> dict:
        parser = make_parser(c.out.reasoning_open) if make_parser is not None else None
        fields = final_message(parser, c.text) if parser is not None else {"content": c.text, "tool_calls": None}
        if fields["content"] is not None or echo:
            fields["content"] = echo + (fields["content"] or "")
        return {
            "index": c.index,
            "message": {"role": "assistant", **fields},
            "logprobs": await chat_logprobs(client, c.out) if req.logprobs else None,
            "finish_reason": finish_reason(parser, c.finish_reason),
            "matched_stop": c.matched_stop,
        }

    return await respond(
        client,
        request,
        [pb],
        req.n or 1,
        response_head("chatcmpl", rid, model),
        ("chat.completion", "chat.completion.chunk"),
        req.stream_options,
        _delta_choice(client, echo, req.logprobs, make_parser),
        final_choice,
        prompt_logprobs if req.prompt_logprobs is not None else None,
    )
