"""The gateway's only peer: the tokenizer service's ``Tokenizer`` gRPC API.

``open_stream`` starts a ``Generate`` call and waits for its first output, so that every
error the tokenizer can report before dispatch (validation, context length, duplicate rid,
queue full) reaches the client as a JSON error, never after the first SSE byte.
Every request is first checked against the tokenizer's prompt bounds (``ringserve.prompt_bounds``,
from ``GetModelInfo``): one that cannot fit is refused here with the tokenizer's own error,
before it is encoded (a 15 MB prompt: ~20 ms of this event loop and as much of the tokenizer's).
Cancelling a call (client disconnect) makes the tokenizer send AbortReq downstream.
Each ``Generate`` call carries the gateway's ``request_timeout_s`` as its gRPC deadline;
when it passes, the tokenizer aborts the rid and the call ends DEADLINE_EXCEEDED, which
reaches the client as 504 ``timeout_error`` (an error event then ``[DONE]`` once
streaming). With ``log_requests`` the request and each output's text are logged.

Several tokenizer instances are reached through one channel whose target resolves to
all of them (``ipv4:a:p,b:p``, or ``dns:///<headless-service>:<port>``): gRPC's own
``round_robin`` load balancing spreads the calls (each call stays on one instance, the
one that owns its rid).

With API keys every call carries ``authorization: Bearer <first key>`` metadata (the
tokenizer requires it on its ``Tokenizer`` service; health needs none).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import text_format

from ringserve import grpcutil, tracing
from ringserve.prompt_bounds import BoundExceeded, PromptBounds
from ringserve.v1 import common_pb2, lora_pb2, tokenizer_pb2, tokenizer_pb2_grpc

from .config import GatewayConfig
from .errors import GatewayError, from_rpc_error, invalid
from .metrics import GatewayMetrics, RequestMetrics

logger = logging.getLogger(__name__)

# gRPC's built-in round_robin policy over every address the target resolves to
# (the default, pick_first, would send every call to the first one).
ROUND_ROBIN = ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]}))

# Generate calls of one request waiting for their first output (see open_streams): a quarter
# of gRPC's default queue of calls a server has not taken up yet.
MAX_OPENING_CALLS = 256

# Bounds the per-id cache of logprob token pieces (a vocabulary is at most a few 100k ids).
_MAX_CACHED_PIECES = 1 << 20


@dataclass(frozen=True)
class TokenPiece:
    """One token id decoded alone (``text``) and its raw bytes."""

    text: str
    raw: bytes


class GenerateStream:
    """One ``Generate`` call whose first output (or end) has already arrived."""

    def __init__(
        self,
        call: grpc.aio.UnaryStreamCall,
        first: tokenizer_pb2.GenerateOutput | None,
        metrics: RequestMetrics | None = None,
        on_error: Callable[[grpc.aio.AioRpcError], GatewayError] = from_rpc_error,
        on_output: Callable[[tokenizer_pb2.GenerateOutput], None] | None = None,
    ) -> None:
        self._call = call
        self._first = first
        self._metrics = metrics
        self._on_error = on_error
        self._on_output = on_output

    async def __aiter__(self) -> AsyncIterator[tokenizer_pb2.GenerateOutput]:
        """Yield every output; a gRPC error raises GatewayError."""
        try:
            if self._first is None:
                return
            first, self._first = self._first, None
            yield first
            while True:
                try:
                    out = await self._call.read()
                except grpc.aio.AioRpcError as exc:
                    raise self._on_error(exc) from None
                if out is grpc.aio.EOF:
                    return
                if self._metrics is not None:
                    self._metrics.on_output(out)
                if self._on_output is not None:
                    self._on_output(out)
                yield out
        finally:
            self._close_metrics()

    def cancel(self) -> None:
        """Cancel the call (no-op once it has finished); the tokenizer aborts the rid."""
        self._call.cancel()
        self._close_metrics()

    def _close_metrics(self) -> None:
        if self._metrics is not None:
            self._metrics.close()


@dataclass(frozen=True)
class ModelCard:
    served_model_name: str
    model_path: str
    context_length: int
    info: tokenizer_pb2.ModelInfo

    @property
    def bounds(self) -> PromptBounds:
        """The tokenizer's prompt bounds, checked here too, before a request is encoded and sent."""
        info = self.info
        return PromptBounds(info.context_length, info.vocab_size, info.chars_per_token or None)


# The bound each unary RPC's request is checked against before it is sent.
_UNARY_BOUNDS: dict[str, Callable[[PromptBounds, Any], None]] = {
    "Tokenize": PromptBounds.check_tokenize,
    "Detokenize": PromptBounds.check_detokenize,
    "TokenPieces": PromptBounds.check_token_pieces,
}


class TokenizerClient:
    """Async client over one channel to the tokenizer service; caches the model info."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None) -> None:
        self._config = config
        self._channel = grpcutil.channel(config.tokenizer, config.transport, extra_options=(ROUND_ROBIN,))
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self._channel)
        self._metadata = config.api_keys.metadata()
        self.metrics = metrics or GatewayMetrics(config.served_model_name)
        self._card: ModelCard | None = None
        self._pieces: dict[int, TokenPiece] = {}  # vocabulary cache for logprobs

    async def close(self) -> None:
        await self._channel.close()

    async def open_stream(self, req: tokenizer_pb2.GenerateReqInput, observe: bool = True) -> GenerateStream:
        """Start ``Generate`` and wait for its first output; ``observe`` feeds /metrics.

        Raises:
            GatewayError: the status the tokenizer returned before its first output.
        """
        started = time.monotonic()
        await self.check_bounds(PromptBounds.check_generate, req)
        # Traced: the request's span is current here, and the tokenizer continues it.
        call = self.stub.Generate(req, timeout=self._config.request_timeout_s,
                                  metadata=self._metadata + tracing.grpc_metadata())
        log_output = None
        if self._config.log_requests:
            logger.info("request %s: %s", req.rid, text_format.MessageToString(req, as_one_line=True))
            log_output = lambda out: logger.info("output %s: %r", out.rid, out.text)  # noqa: E731
        n = req.sampling_params.n if req.sampling_params.HasField("n") else 1
        try:
            first = await call.read()
        except grpc.aio.AioRpcError as exc:
            error = self._rpc_error(exc)
            if error.status >= 500:  # cut off by the server (a refusal, 4xx, is no request begun)
                logger.warning("request %s ended before its first output: %s %s", req.rid, error.status, error.message)
                if observe:
                    with contextlib.suppress(GatewayError):  # the tokenizer is gone too: no label to count under
                        await self._name_metrics()
                    self.metrics.cut_off(n)
            raise error from None
        except BaseException:  # the client went away (or a sibling call of its batch failed)
            call.cancel()
            if observe:
                self.metrics.cut_off(n)
            raise
        if first is grpc.aio.EOF:
            return GenerateStream(call, None)
        if log_output is not None:
            log_output(first)
        tracker = None
        if observe:
            try:
                await self._name_metrics()
            except BaseException:
                call.cancel()
                raise
            tracker = self.metrics.request(n, req.stream, started)
            tracker.on_output(first)
        return GenerateStream(call, first, tracker, self._rpc_error, log_output)

    async def _name_metrics(self) -> None:
        """Label /metrics with the served name, asked of the tokenizer once.

        Raises:
            GatewayError(503): the tokenizer cannot be reached.
        """
        if not self.metrics.model_name:
            self.metrics.model_name = (await self.model_card()).served_model_name

    def _rpc_error(self, exc: grpc.aio.AioRpcError) -> GatewayError:
        """``from_rpc_error``, naming ``--request-timeout`` when the Generate deadline passed."""
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self._config.request_timeout_s is not None:
            return GatewayError(
                f"the request did not finish within {self._config.request_timeout_s:g} s (--request-timeout)",
                504, "timeout_error", None, "timeout",
            )
        return from_rpc_error(exc)

    async def open_streams(self, reqs: Sequence[tokenizer_pb2.GenerateReqInput]) -> list[GenerateStream]:
        """``open_stream`` for each request, at most MAX_OPENING_CALLS at a time; on any error
        every call is cancelled.

        The bound is why a batch of 1,500 prompts is served: gRPC's server keeps at most
        1,000 calls that the tokenizer has not taken up yet (``grpc.server.max_pending_requests``)
        and cancels the rest (CANCELLED, which read as 503), and the tokenizer takes calls up
        one at a time on its event loop. A call counts until its first output (for a
        non-stream request, its whole answer), so the bound costs nothing while it exceeds
        what the scheduler runs at once.
        """
        if len(reqs) == 1:
            return [await self.open_stream(reqs[0])]
        opening = asyncio.Semaphore(MAX_OPENING_CALLS)

        async def open_one(req: tokenizer_pb2.GenerateReqInput) -> GenerateStream:
            async with opening:
                return await self.open_stream(req)

        tasks = [asyncio.ensure_future(open_one(r)) for r in reqs]
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
                info = await self.stub.GetModelInfo(common_pb2.Empty(), timeout=self._config.rpc_timeout_s,
                                                    metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                raise from_rpc_error(exc) from None
            name = self._config.served_model_name or info.served_model_name or info.model_path
            self._card = ModelCard(name, info.model_path, info.context_length, info)
        return self._card

    async def check_model(self, model: str | None) -> str:
        """The served model name, or the LoRA adapter ``model`` names; a request naming another
        model gets 404 model_not_found."""
        return (await self.resolve_model(model))[0]

    async def resolve_model(self, model: str | None) -> tuple[str, str]:
        """(the name responses echo, the LoRA adapter to run under: "" for the base model).
        An adapter is a name the schedulers list (``ListLoraAdapters``, asked only for a name
        that is not the base model's).

        Raises:
            GatewayError(404 model_not_found): neither the base model nor a loaded adapter.
        """
        name = self._config.served_model_name
        if name is not None and model in (None, name):
            return name, ""  # no round trip when the name is fixed by a flag
        card = await self.model_card()
        if model is None or model in (card.served_model_name, card.model_path):
            return card.served_model_name, ""
        if model in {a.name for a in await self.lora_adapters()}:
            return model, model
        raise GatewayError(
            f"The model '{model}' does not exist; this server serves '{card.served_model_name}'",
            404,
            "invalid_request_error",  # OpenAI's type for an unknown model (C05)
            "model",
            "model_not_found",
        )

    async def lora_adapters(self) -> list[lora_pb2.LoraAdapter]:
        """The LoRA adapters the schedulers serve now (none where LoRA is off, or from a
        tokenizer without the LoRA RPCs)."""
        try:
            listed = await self.stub.ListLoraAdapters(common_pb2.Empty(), timeout=self._config.rpc_timeout_s,
                                                      metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return []
            raise from_rpc_error(exc) from None
        return list(listed.adapters)

    async def readiness(self) -> tokenizer_pb2.Readiness:
        """The tokenizer's ``GetReadiness``: whether it can move a token, and why not.

        A tokenizer that does not answer within ``health_timeout_s`` is reported as not
        ready, with the reason ``tokenizer_unavailable`` (never raises).
        """
        try:
            return await self.stub.GetReadiness(common_pb2.Empty(), timeout=self._config.health_timeout_s,
                                                metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            message = f"the tokenizer at {self._config.tokenizer} did not answer ({exc.code().name}: {exc.details()})"
            return tokenizer_pb2.Readiness(ready=False, not_ready=[
                tokenizer_pb2.NotReady(reason="tokenizer_unavailable", message=message)])

    async def check_bounds(self, check: Callable[[PromptBounds, Any], None], req: Any) -> None:
        """``check`` (a ``PromptBounds`` method) on ``req`` with the served model's bounds.

        Raises:
            GatewayError: 400 with the tokenizer's message, param and code, when over a bound;
                503 when the tokenizer cannot be reached.
        """
        try:
            check((await self.model_card()).bounds, req)
        except BoundExceeded as exc:
            raise invalid(exc.message, exc.param, exc.code) from None

    async def unary(self, method: str, request: object) -> object:
        """Call a unary Tokenizer RPC by name (its input bound checked first), mapping gRPC errors
        to GatewayError."""
        if method in _UNARY_BOUNDS:
            await self.check_bounds(_UNARY_BOUNDS[method], request)
        try:
            return await getattr(self.stub, method)(request, timeout=self._config.rpc_timeout_s,
                                                    metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None

    async def embed(self, request: tokenizer_pb2.EmbedRequest) -> tokenizer_pb2.EmbedResponse:
        """The ``Embed`` RPC, under the Generate calls' deadline (``request_timeout_s``).

        Raises:
            GatewayError: the tokenizer's status (400 naming ``input`` or ``dimensions``, ...).
        """
        try:
            return await self.stub.Embed(request, timeout=self._config.request_timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise self._rpc_error(exc) from None

    async def cluster_load(self) -> list[tokenizer_pb2.ClusterLoad]:
        """``GetClusterLoad`` of every tokenizer instance the target resolves to.

        Raises:
            GatewayError: the target does not resolve, or an instance does not answer.
        """
        addresses = await resolve_target(self._config.tokenizer)

        async def one(address: str) -> tokenizer_pb2.ClusterLoad:
            async with grpcutil.channel(address, self._config.transport) as channel:
                stub = tokenizer_pb2_grpc.TokenizerStub(channel)
                try:
                    return await stub.GetClusterLoad(common_pb2.Empty(), timeout=self._config.rpc_timeout_s,
                                                     metadata=self._metadata)
                except grpc.aio.AioRpcError as exc:
                    raise from_rpc_error(exc) from None

        return list(await asyncio.gather(*(one(a) for a in addresses)))

    async def token_pieces(self, ids: Sequence[int]) -> dict[int, TokenPiece]:
        """The text and raw bytes of each token id alone (special tokens kept), for logprobs.

        Ids not seen before are fetched in one ``TokenPieces`` call and cached for the life
        of the gateway (the cache is cleared if it ever outgrows any real vocabulary).

        Raises:
            GatewayError: the tokenizer's error (e.g. an id outside the vocabulary).
        """
        missing = sorted({i for i in ids if i not in self._pieces})
        if missing:
            resp = await self.unary("TokenPieces", tokenizer_pb2.TokenIds(ids=missing))
            if len(self._pieces) + len(missing) > _MAX_CACHED_PIECES:
                self._pieces.clear()
            for token_id, text, raw in zip(missing, resp.texts, resp.token_bytes, strict=True):  # type: ignore[attr-defined]
                self._pieces[token_id] = TokenPiece(text, raw)
        return {i: self._pieces[i] for i in ids}


async def resolve_target(target: str) -> list[str]:
    """Every address a gRPC channel target names, as plain channel targets.

    ``host:port`` and ``unix:path`` name one; ``ipv4:a:p,b:p`` (and ``ipv6:``) list
    several; ``dns:///name:port`` (or ``dns:name:port``) names every address the name
    resolves to now, as ``ip:port`` (gRPC's name syntax, doc/naming.md).

    Raises:
        GatewayError(503): a dns name that does not resolve.
    """
    scheme, sep, rest = target.partition(":")
    if sep and scheme in ("ipv4", "ipv6"):
        return [a for a in rest.split(",") if a]
    if not (sep and scheme == "dns"):
        return [target]
    host_port = rest.removeprefix("//").split("/", 1)[-1]  # drop an optional authority
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        host, port = host_port, "443"  # gRPC's default port for a dns target
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise GatewayError(f"the tokenizer target {target!r} does not resolve: {exc}", 503,
                           "service_unavailable_error") from None
    out: list[str] = []
    for family, _, _, _, sockaddr in infos:
        ip, port_number = sockaddr[0], sockaddr[1]
        if not (isinstance(ip, str) and isinstance(port_number, int)):  # AF_INET(6): (host, port, ...)
            continue
        address = f"[{ip}]:{port_number}" if family == socket.AF_INET6 else f"{ip}:{port_number}"
        if address not in out:
            out.append(address)
    return out
