"""A small typed client for ringserve's public gRPC API (the tokenizer's ``Tokenizer`` service).

Sync and asyncio flavours over the generated stubs. Both stream
``tokenizer_pb2.GenerateOutput`` messages; ``Chunk`` is a plain view of one.

Example::

    from ringserve.client import RingserveClient
    with RingserveClient("127.0.0.1:30010") as client:
        for chunk in client.chat([{"role": "user", "content": "Hi!"}], max_new_tokens=32):
            print(chunk.text, end="", flush=True)

Errors: every method raises ``grpc.RpcError`` (sync) or ``grpc.aio.AioRpcError``
(async) with the service's status code: INVALID_ARGUMENT for a bad request
(its ``details()`` says why), ALREADY_EXISTS for a duplicate rid,
RESOURCE_EXHAUSTED when the queue is full, UNAVAILABLE when a backend is down.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from ringserve.grpcutil import CHANNEL_OPTIONS
from ringserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

FINISH_NAMES = {
    common_pb2.FINISH_NONE: None,
    common_pb2.FINISH_STOP: "stop",
    common_pb2.FINISH_LENGTH: "length",
    common_pb2.FINISH_ABORT: "abort",
}


@dataclass(frozen=True)
class Chunk:
    """One streamed output of one choice."""

    rid: str
    index: int
    text: str
    output_ids: tuple[int, ...]
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    matched_stop: str | int | None
    prompt_tokens: int
    completion_tokens: int

    @classmethod
    def from_proto(cls, out: tokenizer_pb2.GenerateOutput) -> Chunk:
        fr = out.finish_reason
        which = fr.WhichOneof("matched")
        return cls(
            rid=out.rid,
            index=out.index,
            text=out.text,
            output_ids=tuple(out.output_ids),
            finish_reason=FINISH_NAMES[fr.type],
            matched_stop=getattr(fr, which) if which else None,
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
        )


def _sampling(params: Mapping[str, Any]) -> common_pb2.SamplingParams:
    """Build SamplingParams from keyword arguments named as in the proto (max_new_tokens, stop, ...)."""
    sp = common_pb2.SamplingParams()
    for key, value in params.items():
        if value is None:
            continue
        if key in ("stop", "stop_token_ids"):
            getattr(sp, key).extend([value] if isinstance(value, (str, int)) else value)
        elif key == "logit_bias":
            sp.logit_bias.update({int(k): float(v) for k, v in value.items()})
        else:
            setattr(sp, key, value)
    return sp


def chat_request(
    messages: Sequence[Mapping[str, str]], *, rid: str = "", stream: bool = True, **sampling: Any
) -> tokenizer_pb2.GenerateReqInput:
    """A GenerateReqInput for chat ``messages`` ({"role", "content"} dicts)."""
    chat = tokenizer_pb2.ChatInput(
        messages=[tokenizer_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages]
    )
    return tokenizer_pb2.GenerateReqInput(
        rid=rid, chat=chat, stream=stream, sampling_params=_sampling(sampling)
    )


def text_request(
    text: str, *, rid: str = "", stream: bool = True, **sampling: Any
) -> tokenizer_pb2.GenerateReqInput:
    """A GenerateReqInput for a raw text prompt (no chat template)."""
    return tokenizer_pb2.GenerateReqInput(
        rid=rid, text=text, stream=stream, sampling_params=_sampling(sampling)
    )


class RingserveClient:
    """Blocking client. ``target`` is "host:port" of a tokenizer instance."""

    def __init__(self, target: str):
        self._channel = grpc.insecure_channel(target, options=list(CHANNEL_OPTIONS))
        self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)

    def __enter__(self) -> RingserveClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(self, request: tokenizer_pb2.GenerateReqInput, timeout_s: float | None = None) -> Iterator[Chunk]:
        """Stream the outputs of one request; closing the iterator cancels (aborts) it."""
        call = self._stub.Generate(request, timeout=timeout_s)
        try:
            for out in call:
                yield Chunk.from_proto(out)
        finally:
            call.cancel()

    def chat(self, messages: Sequence[Mapping[str, str]], **kwargs: Any) -> Iterator[Chunk]:
        return self.generate(chat_request(messages, **kwargs))

    def complete(self, text: str, **kwargs: Any) -> Iterator[Chunk]:
        return self.generate(text_request(text, **kwargs))

    def model_info(self) -> tokenizer_pb2.ModelInfo:
        return self._stub.GetModelInfo(common_pb2.Empty())

    def abort(self, rid: str) -> bool:
        return self._stub.Abort(tokenizer_pb2.AbortRequest(rid=rid)).found


class AsyncRingserveClient:
    """asyncio client. ``target`` is "host:port" of a tokenizer instance."""

    def __init__(self, target: str):
        self._channel = grpc.aio.insecure_channel(target, options=list(CHANNEL_OPTIONS))
        self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)

    async def __aenter__(self) -> AsyncRingserveClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(
        self, request: tokenizer_pb2.GenerateReqInput, timeout_s: float | None = None
    ) -> AsyncIterator[Chunk]:
        """Stream the outputs of one request; leaving the loop early cancels (aborts) it."""
        call = self._stub.Generate(request, timeout=timeout_s)
        try:
            async for out in call:
                yield Chunk.from_proto(out)
        finally:
            call.cancel()

    def chat(self, messages: Sequence[Mapping[str, str]], **kwargs: Any) -> AsyncIterator[Chunk]:
        return self.generate(chat_request(messages, **kwargs))

    def complete(self, text: str, **kwargs: Any) -> AsyncIterator[Chunk]:
        return self.generate(text_request(text, **kwargs))

    async def model_info(self) -> tokenizer_pb2.ModelInfo:
        return await self._stub.GetModelInfo(common_pb2.Empty())

    async def abort(self, rid: str) -> bool:
        return (await self._stub.Abort(tokenizer_pb2.AbortRequest(rid=rid))).found
