"""The gateway's only peer: the tokenizer service's ``Tokenizer`` gRPC API.

``open_stream`` starts a ``Generate`` call and waits for its first output, so that every
error the tokenizer can report before dispatch (validation, context length, duplicate rid,
queue full) reaches the client as a JSON error, never after the first SSE byte.
Cancelling a call (client disconnect) makes the tokenizer send AbortReq downstream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from ringserve import grpcutil
from ringserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc

from .config import GatewayConfig
from .errors import GatewayError, from_rpc_error


class GenerateStream:
    """One ``Generate`` call whose first output (or end) has already arrived."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, first: tokenizer_pb2.GenerateOutput | None) -> None:
        self._call = call
        self._first = first

    async def __aiter__(self) -> AsyncIterator[tokenizer_pb2.GenerateOutput]:
        """Yield every output; a gRPC error raises GatewayError."""
        if self._first is None:
            return
        first, self._first = self._first, None
        yield first
        while True:
            try:
                out = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc) from None
            if out is grpc.aio.EOF:
                return
            yield out

    def cancel(self) -> None:
        """Cancel the call (no-op once it has finished); the tokenizer aborts the rid."""
        self._call.cancel()


@dataclass(frozen=True)
class ModelCard:
    served_model_name: str
    model_path: str
    context_length: int
    info: tokenizer_pb2.ModelInfo


class TokenizerClient:
    """Async client over one channel to the tokenizer service; caches the model info."""

    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._channel = grpcutil.insecure_channel(config.tokenizer)
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
        self._card: ModelCard | None = None
        self._token_text: dict[int, str] = {}  # vocabulary cache for logprobs; bounded by the vocab size

    async def close(self) -> None:
        await self._channel.close()

    async def open_stream(self, req: tokenizer_pb2.GenerateReqInput) -> GenerateStream:
        """Start ``Generate`` and wait for its first output.

        Raises:
            GatewayError: the status the tokenizer returned before its first output.
        """
        call = self.stub.Generate(req)
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None
        except BaseException:
            call.cancel()
            raise
        return GenerateStream(call, None if first is grpc.aio.EOF else first)

    async def open_streams(self, reqs: Sequence[tokenizer_pb2.GenerateReqInput]) -> list[GenerateStream]:
        """``open_stream`` for each request, concurrently; on any error every call is cancelled."""
        if len(reqs) == 1:
            return [await self.open_stream(reqs[0])]
        tasks = [asyncio.ensure_future(self.open_stream(r)) for r in reqs]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
                if task.done() and not task.cancelled() and task.exception() is None:
                    task.result().cancel()
            raise

    async def model_card(self) -> ModelCard:
        """The served model (cached after the first success).

        Raises:
            GatewayError(503): the tokenizer cannot be reached.
        """
        if self._card is None:
            try:
                info = await self.stub.GetModelInfo(common_pb2.Empty(), timeout=self._config.rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc) from None
            name = self._config.served_model_name or info.served_model_name or info.model_path
            self._card = ModelCard(name, info.model_path, info.context_length, info)
        return self._card

    async def check_model(self, model: str | None) -> str:
        """The served model name; a request naming another model gets 404 model_not_found."""
        name = self._config.served_model_name
        if name is not None and model in (None, name):
            return name  # no round trip when the name is fixed by a flag
        card = await self.model_card()
        if model is not None and model not in (card.served_model_name, card.model_path):
            raise GatewayError(
                f"The model '{model}' does not exist; this server serves '{card.served_model_name}'",
                404,
                "not_found_error",
                "model",
                "model_not_found",
            )
        return card.served_model_name

    async def serving(self) -> bool:
        """True when the tokenizer's gRPC health says SERVING (it does only with its peers up)."""
        return await grpcutil.wait_serving(self._channel, "", self._config.health_timeout_s)

    async def unary(self, method: str, request: object) -> object:
        """Call a unary Tokenizer RPC by name, mapping gRPC errors to GatewayError."""
        try:
            return await getattr(self.stub, method)(request, timeout=self._config.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def token_texts(self, ids: Sequence[int]) -> dict[int, str]:
        """The text of each token id alone (special tokens kept), for logprobs.

        The tokenizer has no batch per-token decode, so unknown ids are decoded one call
        each, concurrently, and cached for the life of the gateway.
        """
        missing = sorted({i for i in ids if i not in self._token_text})
        if missing:
            texts = await asyncio.gather(
                *(self.unary("Detokenize", tokenizer_pb2.DetokenizeRequest(ids=[i])) for i in missing)
            )
            for token_id, resp in zip(missing, texts):
                self._token_text[token_id] = resp.text  # type: ignore[attr-defined]
        return {i: self._token_text[i] for i in ids}
