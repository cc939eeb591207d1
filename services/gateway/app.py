"""The FastAPI application: routes, error handlers, API key check.

``create_app(config)`` builds an app whose lifespan opens one gRPC channel to the tokenizer
service; nothing else is kept between requests.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from google.protobuf.message import Message
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ringserve.v1 import common_pb2, tokenizer_pb2

from . import convert, serving_chat, serving_completions, serving_native, sse
from .backend import TokenizerClient
from .config import GatewayConfig
from .errors import HANDLERS, GatewayError, invalid
from .protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)

# Probes must work without the key.
OPEN_PATHS = frozenset({"/health"})


class ApiKeyMiddleware:
    """Pure ASGI (it must not buffer SSE): ``Authorization: Bearer <key>`` or a 401 error."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self.expected):
                error = GatewayError(
                    "Incorrect or missing API key; send 'Authorization: Bearer <key>'",
                    401,
                    "authentication_error",
                    None,
                    "invalid_api_key",
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class CurlJsonMiddleware:
    """Read a form-encoded POST body as JSON: ``curl -d '{...}'`` sends JSON with curl's
    default Content-Type, and every endpoint here takes JSON only."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            if len(headers) != len(scope["headers"]) and Headers(scope=scope).get("content-type", "").startswith(
                "application/x-www-form-urlencoded"
            ):
                scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def _proto_dict(msg: Message) -> dict:
    """A flat proto message as JSON-ready fields (int64 stays a number, unlike MessageToDict)."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        out[f.name] = value if isinstance(value, (bool, int, float, str)) else list(value)
    return out


def _model_entry(card_name: str, root: str, context_length: int) -> dict:
    return {
        "id": card_name,
        "object": "model",
        "created": 0,
        "owned_by": "ringserve",
        "root": root,
        "max_model_len": context_length,
    }


def create_app(config: GatewayConfig) -> FastAPI:
    """The gateway app for ``config``; its lifespan owns the tokenizer channel."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.client = TokenizerClient(config)
        try:
            yield
        finally:
            await app.state.client.close()

    app = FastAPI(title="ringserve gateway", lifespan=lifespan, strict_content_type=False)
    for exc_type, handler in HANDLERS.items():
        app.add_exception_handler(exc_type, handler)
    app.add_exception_handler(sse.ClientDisconnected, lambda *_: Response(status_code=499))
    app.add_middleware(CurlJsonMiddleware)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)

    def client_of(request: Request) -> TokenizerClient:
        return request.app.state.client

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving_chat.create_chat_completion(client_of(request), request, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving_completions.create_completion(client_of(request), request, body)

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        return await serving_native.generate(client_of(request), request, body)

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest, request: Request) -> Response:
        return await serving_native.abort_request(client_of(request), body)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        card = await client_of(request).model_card()
        entry = _model_entry(card.served_model_name, card.model_path, card.context_length)
        return sse.json_response({"object": "list", "data": [entry]})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str, request: Request) -> Response:
        client = client_of(request)
        name = await client.check_model(model_id)
        card = await client.model_card()
        return sse.json_response(_model_entry(name, card.model_path, card.context_length))

    @app.get("/get_model_info")
    async def get_model_info(request: Request) -> Response:
        card = await client_of(request).model_card()
        info = _proto_dict(card.info)
        return sse.json_response({**info, "served_model_name": card.served_model_name, "is_generation": True})

    @app.get("/get_load")
    async def get_load(request: Request) -> Response:
        load = await client_of(request).unary("GetLoad", common_pb2.Empty())
        return sse.json_response(_proto_dict(load))

    @app.get("/health")
    async def health(request: Request) -> Response:
        if await client_of(request).serving():
            return sse.json_response({"status": "ok"})
        return GatewayError(
            "the tokenizer service is not serving",
            503,
            "service_unavailable_error",
            code="service_unavailable",
            retry_after=True,
        ).response()

    @app.post("/v1/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        client = client_of(request)
        await client.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise invalid("give exactly one of prompt and messages", "prompt")
        pb = tokenizer_pb2.TokenizeRequest(add_special_tokens=body.add_special_tokens)
        if body.prompt is not None:
            pb.text = body.prompt
        else:
            pb.chat.CopyFrom(
                convert.chat_input(
                    body.messages or [],
                    body.add_generation_prompt,
                    body.continue_final_message,
                    body.chat_template_kwargs,
                    body.tools,
                )
            )
        resp = await client.unary("Tokenize", pb)
        return sse.json_response(
            {
                "tokens": list(resp.input_ids),  # type: ignore[attr-defined]
                "count": resp.count,  # type: ignore[attr-defined]
                "max_model_len": resp.max_model_len,  # type: ignore[attr-defined]
                "prompt": resp.prompt,  # type: ignore[attr-defined]
            }
        )

    @app.post("/v1/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        client = client_of(request)
        await client.check_model(body.model)
        pb = tokenizer_pb2.DetokenizeRequest(ids=body.tokens, skip_special_tokens=body.skip_special_tokens)
        resp = await client.unary("Detokenize", pb)
        return sse.json_response({"prompt": resp.text})  # type: ignore[attr-defined]

    return app
