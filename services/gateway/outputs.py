"""From ``GenerateOutput`` streams to per-choice updates, finish reasons and usage.

Shared by the chat, completions and native endpoints. A request with several prompts (a
completions batch) has one stream per prompt; choice ``j`` of prompt ``i`` gets the global
index ``i * n + j``, as OpenAI numbers them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from ringserve.v1 import common_pb2, tokenizer_pb2

from . import sse
from .backend import GenerateStream
from .errors import GatewayError, from_status_name
from .protocol import StreamOptions

_FINISH = {
    common_pb2.FINISH_STOP: "stop",
    common_pb2.FINISH_LENGTH: "length",
    common_pb2.FINISH_ABORT: "abort",
}
# Aborts that are an ordinary end of the request (an operator's /abort_request); any other
# status on an abort is an error after dispatch and is reported as one.
_PLAIN_ABORT = {"", "CANCELLED", "ABORTED"}


def finish_reason(fr: common_pb2.FinishReason) -> tuple[str | None, str | int | None]:
    """(finish_reason, matched_stop) of one output; (None, None) while running.

    Raises:
        GatewayError: an abort carrying an error status (e.g. UNAVAILABLE after dispatch).
    """
    if fr.type == common_pb2.FINISH_NONE:
        return None, None
    if fr.type == common_pb2.FINISH_ABORT and fr.status not in _PLAIN_ABORT:
        raise from_status_name(fr.status, fr.message)
    kind = fr.WhichOneof("matched")
    matched = fr.matched_str if kind == "matched_str" else fr.matched_token_id if kind else None
    return _FINISH.get(fr.type, "stop"), matched


@dataclass
class Usage:
    """Token counts: prompt tokens once per prompt, completion tokens summed over choices."""

    prompt: dict[int, int] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)
    completion: dict[int, int] = field(default_factory=dict)  # global choice index -> tokens

    def add(self, prompt_index: int, choice: int, out: tokenizer_pb2.GenerateOutput) -> None:
        self.prompt[prompt_index] = max(self.prompt.get(prompt_index, 0), out.prompt_tokens)
        self.cached[prompt_index] = max(self.cached.get(prompt_index, 0), out.cached_tokens)
        self.completion[choice] = max(self.completion.get(choice, 0), out.completion_tokens)

    def to_dict(self) -> dict:
        prompt = sum(self.prompt.values())
        completion = sum(self.completion.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
        }


async def merge(streams: Sequence[GenerateStream]) -> AsyncIterator[tuple[int, tokenizer_pb2.GenerateOutput]]:
    """(prompt index, output) from every stream as they arrive; every call is cancelled
    when the consumer stops early (disconnect, error)."""
    try:
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, stream: GenerateStream) -> None:
            try:
                async for out in stream:
                    await queue.put((i, out))
                await queue.put((i, done))
            except Exception as exc:  # re-raised in the consumer
                await queue.put((i, exc))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for stream in streams:
            stream.cancel()


@dataclass
class ChoiceUpdate:
    """One output as a choice sees it."""

    index: int  # global choice index
    prompt_index: int
    text: str
    first: bool  # the first update of this choice
    finish_reason: str | None
    matched_stop: str | int | None
    out: tokenizer_pb2.GenerateOutput


async def updates(streams: Sequence[GenerateStream], n: int, usage: Usage) -> AsyncIterator[ChoiceUpdate]:
    """Per-choice updates of a request, with usage kept current.

    Raises:
        GatewayError: a gRPC error mid-stream, or an abort with an error status.
    """
    seen: set[int] = set()
    async for prompt_index, out in merge(streams):
        index = prompt_index * n + out.index
        usage.add(prompt_index, index, out)
        reason, matched = finish_reason(out.finish_reason)
        first = index not in seen
        seen.add(index)
        yield ChoiceUpdate(index, prompt_index, out.text, first, reason, matched, out)


@dataclass
class FinalChoice:
    index: int
    prompt_index: int
    text: str
    finish_reason: str | None
    matched_stop: str | int | None
    out: tokenizer_pb2.GenerateOutput  # the choice's final output


async def collect(streams: Sequence[GenerateStream], n: int, usage: Usage) -> list[FinalChoice]:
    """The final state of every choice of a non-stream request, by index. The tokenizer sends
    the whole text of a choice in its final output (``stream=false``), so the last one wins."""
    final: dict[int, FinalChoice] = {}
    async for u in updates(streams, n, usage):
        final[u.index] = FinalChoice(u.index, u.prompt_index, u.text, u.finish_reason, u.matched_stop, u.out)
    return [final[i] for i in sorted(final)]


async def sse_events(
    streams: Sequence[GenerateStream],
    n: int,
    usage: Usage,
    event_of: Callable[[ChoiceUpdate], Awaitable[dict | None]],
    tail: Callable[[], dict | None] = lambda: None,
) -> AsyncIterator[bytes]:
    """An SSE body: one event per update (``event_of`` may return None to skip one), then
    ``tail()`` if it gives an event, then ``data: [DONE]``.

    An error after the first byte becomes one error event before ``[DONE]``. Leaving early
    (client disconnect) cancels every gRPC call, which makes the tokenizer abort the rids.
    """
    try:
        async for u in updates(streams, n, usage):
            obj = await event_of(u)
            if obj is not None:
                yield sse.event(obj)
        last = tail()
        if last is not None:
            yield sse.event(last)
    except GatewayError as exc:
        yield sse.error_event(exc)
    finally:
        for stream in streams:
            stream.cancel()
    yield sse.DONE


def sse_chunks(
    streams: Sequence[GenerateStream],
    head: dict,
    n: int,
    usage: Usage,
    choice_of: Callable[[ChoiceUpdate], Awaitable[dict | None]],
    stream_options: StreamOptions | None,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed chat or completions request (OpenAI chunk objects).

    ``choice_of`` turns an update into one chunk choice, or None to send nothing. Content
    chunks carry ``usage: null`` (or the running usage with continuous_usage_stats); with
    include_usage one last chunk has ``choices: []`` and the whole request's usage.
    """
    include_usage = bool(stream_options and stream_options.include_usage)
    continuous = bool(stream_options and stream_options.continuous_usage_stats)

    async def event_of(u: ChoiceUpdate) -> dict | None:
        choice = await choice_of(u)
        if choice is None:
            return None
        return {**head, "choices": [choice], "usage": usage.to_dict() if continuous else None}

    def tail() -> dict | None:
        return {**head, "choices": [], "usage": usage.to_dict()} if include_usage else None

    return sse_events(streams, n, usage, event_of, tail)
