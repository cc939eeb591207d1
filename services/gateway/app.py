"""The FastAPI application: routes, error handlers, API key check.

``create_app(config)`` builds an app whose lifespan opens one gRPC channel to the tokenizer
service; nothing else is kept between requests.
"""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from google.protobuf.message import Message
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as ASGIMessage

from ringserve.apikeys import ApiKeys
from ringserve.v1 import common_pb2, tokenizer_pb2

from . import (
    convert,
    schemas,
    serving_chat,
    serving_completions,
    serving_embeddings,
    serving_lora,
    serving_native,
    serving_responses,
    sse,
)
from .backend import TokenizerClient
from .body import BodyRoute
from .config import GatewayConfig
from .drain import Drain, DrainMiddleware
from .errors import HANDLERS, RETRY_AFTER_S, GatewayError, invalid
from .metrics import CONTENT_TYPE, GatewayMetrics
from .metrics_upstream import UpstreamMetrics
from .protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from .request_context import RequestContextMiddleware

# Probes and Prometheus scrapes must work without the key (vLLM keys only the API routes).
OPEN_PATHS = frozenset({"/health", "/health_generate", "/metrics"})


class ApiKeyMiddleware:
    """Pure ASGI (it must not buffer SSE): ``Authorization: Bearer <key>`` or a 401 error."""

    def __init__(self, app: ASGIApp, api_keys: ApiKeys) -> None:
        self.app = app
        self.api_keys = api_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            if not self.api_keys.accepts(Headers(scope=scope).get("authorization")):
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


class BodyLimitMiddleware:
    """Pure ASGI: a request body over ``limit`` bytes gets 413 before anything parses it.

    A declared Content-Length is checked at once; a chunked body (no Content-Length) is
    read and counted up to the limit, then handed on whole. Later ``receive`` calls (the
    disconnect watch of streaming responses) go to the server as before.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    def _too_large(self, size: str) -> Response:
        return GatewayError(
            f"the request body ({size}) exceeds the limit of {self.limit} bytes (--max-request-body-bytes)",
            413, "invalid_request_error", None, "request_too_large",
        ).response()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > self.limit:
                await self._too_large(f"{int(declared)} bytes")(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client left: let the app see the disconnect
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._too_large(f"over {self.limit} bytes so far")(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        replayed = False

        async def replay() -> ASGIMessage:
            nonlocal replayed
            if not replayed:
                replayed = True
                return message
            return await receive()

        await self.app(scope, replay, send)


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


def cluster_load_json(loads: list[tokenizer_pb2.ClusterLoad]) -> dict[str, list[dict]]:
    """/get_load: one entry per service instance, every LoadReport field in each.

    Args:
        loads: one ClusterLoad per tokenizer instance. Replicas shared by several
            tokenizers appear once (deduplicated by instance_id, first report kept).

    Returns:
        ``{"tokenizer": [...], "scheduler": [...], "detokenizer": [...]}``.
    """
    schedulers: dict[str, dict] = {}
    detokenizers: dict[str, dict] = {}
    for load in loads:
        for report in load.schedulers:
            schedulers.setdefault(report.instance_id, _proto_dict(report))
        for report in load.detokenizers:
            detokenizers.setdefault(report.instance_id, _proto_dict(report))
    return {
        "tokenizer": [_proto_dict(load.tokenizer) for load in loads],
        "scheduler": list(schedulers.values()),
        "detokenizer": list(detokenizers.values()),
    }


def _model_entry(card_name: str, root: str, context_length: int) -> dict:
    return {
        "id": card_name,
        "object": "model",
        "created": 0,
        "owned_by": "ringserve",
        "root": root,
        "max_model_len": context_length,
    }


def _unhealthy(message: str) -> Response:
    return GatewayError(
        message, 503, "service_unavailable_error", code="service_unavailable", retry_after=True
    ).response()


def health_response(readiness: tokenizer_pb2.Readiness) -> Response:
    """/health: 200 ``{"status": "ok", "replicas", "not_ready"}`` while the tokenizer can move a
    token through a replica (``not_ready`` lists the replicas that cannot), else 503 with an
    OpenAI error object beside ``status: "not_ready"`` and the same list."""
    not_ready = [{"replica": r.replica, "reason": r.reason, "message": r.message} for r in readiness.not_ready]
    if readiness.ready:
        return sse.json_response({"status": "ok", "replicas": readiness.replicas, "not_ready": not_ready})
    error = GatewayError("the ring cannot move a token: " + "; ".join(r["message"] for r in not_ready),
                         503, "service_unavailable_error", code="service_unavailable", retry_after=True)
    response = sse.json_response({**error.body(), "status": "not_ready", "replicas": readiness.replicas,
                                  "not_ready": not_ready}, 503)
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


async def _generate_one_token(client: TokenizerClient, timeout_s: float) -> dict:
    """Generate exactly one token through the whole ring (tokenizer, scheduler, detokenizer).

    The probe is a normal request (rid ``health-generate-<hex>``, greedy, ignore_eos) that
    is not counted in /metrics. On timeout its call is cancelled, which aborts the rid.

    Raises:
        GatewayError: the ring reported an error or produced no token.
        TimeoutError: no finished token within ``timeout_s``.
    """
    pb = tokenizer_pb2.GenerateReqInput(
        rid=f"health-generate-{uuid.uuid4().hex}",
        text="ping",
        sampling_params=common_pb2.SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True),
    )
    started = time.monotonic()

    async def run() -> tokenizer_pb2.GenerateOutput | None:
        stream = await client.open_stream(pb, observe=False)
        last = None
        try:
            async for out in stream:
                last = out
        finally:
            stream.cancel()
        return last

    last = await asyncio.wait_for(run(), timeout_s)
    if last is None or last.completion_tokens != 1 or last.finish_reason.type != common_pb2.FINISH_LENGTH:
        raise GatewayError("the generation probe ended without its token", 503, "service_unavailable_error")
    return {"status": "ok", "text": last.text, "completion_tokens": 1, "latency_s": time.monotonic() - started}


def create_app(config: GatewayConfig) -> FastAPI:
    """The gateway app for ``config``; its lifespan owns the tokenizer channel.

    Its OpenAPI schema (``/openapi.json``) declares every request body and the 200 and
    error responses of every route (see ``schemas``).
    """
    metrics = GatewayMetrics(config.served_model_name)
    upstream = UpstreamMetrics(config.metrics_upstreams)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.client = TokenizerClient(config, metrics)
        # Start-up objects are never garbage: a full collection walking them stalled the event
        # loop ~100 ms (measured), and parsing a large body allocates enough to start one.
        gc.freeze()
        try:
            yield
        finally:
            await app.state.client.close()
            await upstream.aclose()

    app = FastAPI(title="ringserve gateway", version="1", lifespan=lifespan, strict_content_type=False)
    app.state.sse_keepalive_s = config.sse_keepalive_s  # read by every SSE response (sse.py)
    app.router.route_class = BodyRoute  # bounded JSON decoding before validation (body.py)
    app.openapi = lambda: schemas.openapi_schema(app)  # type: ignore[method-assign]
    for exc_type, handler in HANDLERS.items():
        app.add_exception_handler(exc_type, handler)
    app.add_exception_handler(sse.ClientDisconnected, lambda *_: Response(status_code=499))
    app.add_middleware(CurlJsonMiddleware)
    app.add_middleware(BodyLimitMiddleware, limit=config.max_request_body_bytes)
    if config.api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=config.api_keys)
    # Outermost of these: a draining gateway refuses before any other check (services.gateway.drain).
    app.state.drain = Drain()
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    # Outside Starlette's error middleware too: a 500 carries X-Request-Id and ends its span.
    build_stack = app.build_middleware_stack
    app.build_middleware_stack = lambda: RequestContextMiddleware(build_stack())  # type: ignore[method-assign]

    def client_of(request: Request) -> TokenizerClient:
        return request.app.state.client

    @app.post("/v1/chat/completions", responses=schemas.ok(schemas.ChatCompletionResponse, stream=True))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving_chat.create_chat_completion(client_of(request), request, body, config)

    app.include_router(serving_responses.router(config))

    @app.post("/v1/completions", responses=schemas.ok(schemas.CompletionResponse, stream=True))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving_completions.create_completion(client_of(request), request, body)

    app.include_router(serving_embeddings.router)  # POST /v1/embeddings

    @app.post("/generate", responses={
        200: {"description": "SGLang native result(s) or an SSE stream", "content": {"text/event-stream": {}}},
        **schemas.ERRORS,
    })
    async def generate(body: GenerateRequest, request: Request) -> Response:
        return await serving_native.generate(client_of(request), request, body)

    @app.post("/abort_request", responses=schemas.ok(schemas.AbortResponse))
    async def abort_request(body: AbortRequest, request: Request) -> Response:
        return await serving_native.abort_request(client_of(request), body)

    @app.get("/v1/models", responses=schemas.ok(schemas.ModelList))
    async def list_models(request: Request) -> Response:
        client = client_of(request)
        card = await client.model_card()
        entry = _model_entry(card.served_model_name, card.model_path, card.context_length)
        return sse.json_response({"object": "list", "data": await serving_lora.model_entries(client, card, entry)})

    @app.get("/v1/models/{model_id:path}", responses=schemas.ok(schemas.ModelEntry))
    async def retrieve_model(model_id: str, request: Request) -> Response:
        client = client_of(request)
        name = await client.check_model(model_id)
        card = await client.model_card()
        base = _model_entry(card.served_model_name, card.model_path, card.context_length)
        entries = await serving_lora.model_entries(client, card, base)  # the entry /v1/models lists
        return sse.json_response(next((e for e in entries if e["id"] == name), {**entries[0], "id": name}))

    serving_lora.add_routes(app, client_of)

    @app.get("/get_model_info", responses=schemas.ERRORS)
    async def get_model_info(request: Request) -> Response:
        card = await client_of(request).model_card()
        info = _proto_dict(card.info)
        return sse.json_response({**info, "served_model_name": card.served_model_name, "is_generation": True})

    # SGLang's clients POST it without a body; the schema declares the GET (a POST here has a body).
    @app.post("/flush_cache", include_in_schema=False)
    @app.get("/flush_cache", responses={200: {"description": "Every replica's prefix cache is empty"},
                                        **schemas.ERRORS})
    async def flush_cache(request: Request) -> Response:
        """SGLang's /flush_cache: 400 ``failed_precondition`` while requests are in flight."""
        await client_of(request).unary("FlushCache", common_pb2.Empty())
        return sse.json_response({"flushed": True})

    @app.get("/get_load", responses=schemas.ERRORS)
    async def get_load(request: Request) -> Response:
        return sse.json_response(cluster_load_json(await client_of(request).cluster_load()))

    @app.get("/health", responses={**schemas.ok(schemas.HealthResponse), 503: {
        "model": schemas.HealthNotReadyResponse, "description": "No replica can move a token (Retry-After)"}})
    async def health(request: Request) -> Response:
        """Readiness: 200 while a token can get through the ring, 503 with the reasons otherwise."""
        return health_response(await client_of(request).readiness())

    @app.get("/health_generate", responses=schemas.ok(schemas.HealthGenerateResponse))
    async def health_generate(request: Request) -> Response:
        """200 once one token went through the whole ring; 503 (OpenAI error) otherwise."""
        timeout_s = config.health_generate_timeout_s
        try:
            return sse.json_response(await _generate_one_token(client_of(request), timeout_s))
        except TimeoutError:
            return _unhealthy(f"no token generated within {timeout_s:g} s")
        except GatewayError as exc:
            return _unhealthy(f"generation failed: {exc.message}")

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition() + await upstream.exposition(), media_type=CONTENT_TYPE)

    @app.post("/v1/tokenize", responses=schemas.ok(schemas.TokenizeResponse))
    async def tokenize(body: TokenizeRequest, request: Request) -> Response:
        client = client_of(request)
        await client.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise invalid("give exactly one of prompt and messages", "prompt")
        pb = tokenizer_pb2.TokenizeRequest(add_special_tokens=body.add_special_tokens)
        if body.prompt is not None:
            pb.text = body.prompt
        else:
            convert.chat_input(
                body.messages or [],
                body.add_generation_prompt,
                body.continue_final_message,
                body.chat_template_kwargs,
                body.tools,
                pb.chat,
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

    @app.post("/v1/detokenize", responses=schemas.ok(schemas.DetokenizeResponse))
    async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
        client = client_of(request)
        await client.check_model(body.model)
        pb = tokenizer_pb2.DetokenizeRequest(ids=body.tokens, skip_special_tokens=body.skip_special_tokens)
        resp = await client.unary("Detokenize", pb)
        return sse.json_response({"prompt": resp.text})  # type: ignore[attr-defined]

    return app
