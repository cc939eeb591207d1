"""A small typed client for ringserve's public gRPC API (the tokenizer's ``Tokenizer`` service).

Sync and asyncio flavours over the generated stubs. Both stream
``tokenizer_pb2.GenerateOutput`` messages; ``Chunk`` is a plain view of one.

Example::

    from ringserve.client import RingserveClient
    with RingserveClient("127.0.0.1:30010", api_key="sk-...") as client:
        for chunk in client.chat([{"role": "user", "content": "Hi!"}], max_new_tokens=32):
            print(chunk.text, end="", flush=True)

Connection: ``api_key`` is sent as ``authorization: Bearer <key>`` metadata on every
call (needed when the server runs with ``--api-key``). Plaintext by default; ``tls=True``
verifies the server against the system roots, ``ca_file`` against that CA, and
``cert_file`` + ``key_file`` add a client certificate (mutual TLS, as the tokenizer
requires under ``--tls-ca-file``).

Deadlines and cancellation: ``timeout_s`` is the call's gRPC deadline; when it passes,
or the caller closes the iterator early (``break``, ``close()``), the call is cancelled
and the server aborts the request (its KV cache and slot are freed).

Errors: every method raises ``grpc.RpcError`` (sync) or ``grpc.aio.AioRpcError``
(async) with the service's status code: UNAUTHENTICATED for a missing or wrong key,
INVALID_ARGUMENT for a bad request (its ``details()`` says why), ALREADY_EXISTS for
a duplicate rid, RESOURCE_EXHAUSTED when the queue is full, DEADLINE_EXCEEDED when
``timeout_s`` passed, UNAVAILABLE when a backend is down.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
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


def channel_credentials(
    tls: bool = False, ca_file: str | Path | None = None,
    cert_file: str | Path | None = None, key_file: str | Path | None = None,
) -> grpc.ChannelCredentials | None:
    """TLS credentials for a channel, or None for plaintext (no TLS option given).

    Raises:
        ValueError: only one of ``cert_file`` and ``key_file``.
    """
    if (cert_file is None) != (key_file is None):
        raise ValueError("cert_file and key_file go together")
    if not tls and ca_file is None and cert_file is None:
        return None
    return grpc.ssl_channel_credentials(_read(ca_file), _read(key_file), _read(cert_file))


def _read(path: str | Path | None) -> bytes | None:
    return Path(path).read_bytes() if path is not None else None


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class RingserveClient:
    """Blocking client. ``target`` is "host:port" of a tokenizer instance (or anything a gRPC
    channel takes, e.g. an Ingress host:443 with ``tls=True``); see the module docstring
    for ``api_key`` and the TLS options."""

    def __init__(self, target: str, *, api_key: str | None = None, tls: bool = False,
                 ca_file: str | Path | None = None, cert_file: str | Path | None = None,
                 key_file: str | Path | None = None):
        creds = channel_credentials(tls, ca_file, cert_file, key_file)
        options = list(CHANNEL_OPTIONS)
        self._channel = (grpc.secure_channel(target, creds, options=options) if creds is not None
                         else grpc.insecure_channel(target, options=options))
        self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
        self._metadata = _auth_metadata(api_key)

    def __enter__(self) -> RingserveClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(self, request: tokenizer_pb2.GenerateReqInput, timeout_s: float | None = None) -> Iterator[Chunk]:
        """Stream the outputs of one request; closing the iterator, or ``timeout_s`` passing,
        cancels (aborts) it."""
        call = self._stub.Generate(request, timeout=timeout_s, metadata=self._metadata)
        try:
            for out in call:
                yield Chunk.from_proto(out)
        finally:
            call.cancel()

    def chat(self, messages: Sequence[Mapping[str, str]], *, timeout_s: float | None = None,
             **kwargs: Any) -> Iterator[Chunk]:
        """``generate`` of ``chat_request(messages, **kwargs)``."""
        return self.generate(chat_request(messages, **kwargs), timeout_s)

    def complete(self, text: str, *, timeout_s: float | None = None, **kwargs: Any) -> Iterator[Chunk]:
        """``generate`` of ``text_request(text, **kwargs)``."""
        return self.generate(text_request(text, **kwargs), timeout_s)

    def model_info(self, timeout_s: float | None = None) -> tokenizer_pb2.ModelInfo:
        return self._stub.GetModelInfo(common_pb2.Empty(), timeout=timeout_s, metadata=self._metadata)

    def abort(self, rid: str, timeout_s: float | None = None) -> bool:
        """Abort the request ``rid`` on this tokenizer instance; whether it was in flight there."""
        return self._stub.Abort(tokenizer_pb2.AbortRequest(rid=rid), timeout=timeout_s,
                                metadata=self._metadata).found


class AsyncRingserveClient:
    """asyncio client; the same arguments as ``RingserveClient``."""

    def __init__(self, target: str, *, api_key: str | None = None, tls: bool = False,
                 ca_file: str | Path | None = None, cert_file: str | Path | None = None,
                 key_file: str | Path | None = None):
        creds = channel_credentials(tls, ca_file, cert_file, key_file)
        options = list(CHANNEL_OPTIONS)
        self._channel = (grpc.aio.secure_channel(target, creds, options=options) if creds is not None
                         else grpc.aio.insecure_channel(target, options=options))
        self._stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
        self._metadata = _auth_metadata(api_key)

    async def __aenter__(self) -> AsyncRingserveClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(
        self, request: tokenizer_pb2.GenerateReqInput, timeout_s: float | None = None
    ) -> AsyncIterator[Chunk]:
        """Stream the outputs of one request; leaving the loop early, or ``timeout_s``
        passing, cancels (aborts) it."""
        call = self._stub.Generate(request, timeout=timeout_s, metadata=self._metadata)
        try:
            async for out in call:
                yield Chunk.from_proto(out)
        finally:
            call.cancel()

    def chat(self, messages: Sequence[Mapping[str, str]], *, timeout_s: float | None = None,
             **kwargs: Any) -> AsyncIterator[Chunk]:
        """``generate`` of ``chat_request(messages, **kwargs)``."""
        return self.generate(chat_request(messages, **kwargs), timeout_s)

    def complete(self, text: str, *, timeout_s: float | None = None, **kwargs: Any) -> AsyncIterator[Chunk]:
        """``generate`` of ``text_request(text, **kwargs)``."""
        return self.generate(text_request(text, **kwargs), timeout_s)

    async def model_info(self, timeout_s: float | None = None) -> tokenizer_pb2.ModelInfo:
        return await self._stub.GetModelInfo(common_pb2.Empty(), timeout=timeout_s, metadata=self._metadata)

    async def abort(self, rid: str, timeout_s: float | None = None) -> bool:
        """Abort the request ``rid`` on this tokenizer instance; whether it was in flight there."""
        return (await self._stub.Abort(tokenizer_pb2.AbortRequest(rid=rid), timeout=timeout_s,
                                       metadata=self._metadata)).found
