"""The ``/v1/responses`` routes: create (one response object, or its typed event stream),
retrieve and delete a stored response.

Every check runs before the first byte: a bad field is a 400 naming it, a tokenizer error
before the first output is its JSON error. The tokenizer streams every response; a
non-streamed one is collected from the same chunks by the same ``ResponseBuilder``. Events
are sent as OpenAI sends them, ``event: <type>`` then ``data: <JSON>``, and the stream ends
with the ``response.completed`` / ``response.incomplete`` / ``response.failed`` event (no
``[DONE]``). A client that goes away cancels the Generate call, which aborts the request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import APIRouter, Request
from starlette.responses import Response

from ringserve import tracing

from . import request_context, schemas, sse
from .backend import GenerateStream, TokenizerClient
from .body import BodyRoute
from .chat_output import mark_reasoning, reported_parser_factory
from .config import GatewayConfig
from .errors import GatewayError, invalid
from .outputs import Usage, updates
from .responses_convert import (
    chat_request,
    generate_request,
    input_items,
    output_as_input,
    refuse_unsupported,
    renamed,
    responses_names,
)
from .responses_output import ResponseBuilder, echo
from .responses_protocol import InputItem, ResponsesRequest
from .responses_schemas import DeletedResponse, ResponseObject
from .responses_store import ResponseStore, Stored, items_bytes


def frame(event: dict) -> bytes:
    """One server-sent event as OpenAI frames the Responses stream."""
    return b"event: " + event["type"].encode() + b"\ndata: " + sse.dumps(event) + b"\n\n"


def not_found(response_id: str, param: str | None = None) -> GatewayError:
    return GatewayError(f"No response with id '{response_id}' is stored on this server (responses are kept in "
                        "the memory of the gateway that served them, a bounded number of them)", 404,
                        "not_found_error", param, "response_not_found")


async def _events(streams: Sequence[GenerateStream], builder: ResponseBuilder, usage: Usage,
                  keep: Callable[[], None]) -> AsyncIterator[bytes]:
    """The SSE body: the builder's events as the outputs arrive; an error after the start is
    one ``response.failed`` event. Leaving early (client disconnect) cancels the call."""
    try:
        for event in builder.start():
            yield frame(event)
        reason = None
        async for u in updates(streams, 1, usage):
            for event in builder.feed(u):
                yield frame(event)
            reason = u.finish_reason
        events = builder.finish(reason)
        keep()  # before the last event: a client that has read it can retrieve the response
        for event in events:
            yield frame(event)
    except GatewayError as exc:
        for event in builder.fail(renamed(exc)):
            yield frame(event)
    finally:
        for stream in streams:
            stream.cancel()


def _span_attributes(req: ResponsesRequest) -> dict:
    """The OpenTelemetry GenAI request attributes of ``req`` (those it gives)."""
    attrs = {tracing.GEN_AI_OPERATION: "chat", tracing.GEN_AI_REQUEST_MODEL: req.model,
             tracing.GEN_AI_REQUEST_MAX_TOKENS: req.max_output_tokens,
             tracing.GEN_AI_REQUEST_TEMPERATURE: req.temperature}
    return {k: v for k, v in attrs.items() if v is not None}


async def create_response(
    client: TokenizerClient, request: Request, req: ResponsesRequest, config: GatewayConfig, store: ResponseStore
) -> Response:
    """Serve ``POST /v1/responses``.

    Raises:
        GatewayError: a refused field (400), an unknown previous_response_id or model (404),
            tokenizer errors before the first output (mapped).
        ClientDisconnected: the client went away before the response started.
    """
    refuse_unsupported(req, store.enabled)
    previous: tuple[InputItem, ...] = ()
    previous_bytes = 0
    if req.previous_response_id is not None:
        entry = store.get(req.previous_response_id)
        if entry is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        previous, previous_bytes = entry.conversation, entry.conversation_bytes
    new_items = input_items(req)
    items = (*previous, *new_items)
    chat = chat_request(req, items)
    # The rid is the request's X-Request-Id (or a fresh one, request_context); the response's
    # own id is new each time, so a client's reused X-Request-Id never names two stored responses.
    rid = request_context.adopt(None, lambda: _span_attributes(req))
    pb = generate_request(req, chat, rid)
    mark_reasoning(pb, chat, config)
    make_parser = await reported_parser_factory(client, chat, config)
    model, pb.lora_name = await client.resolve_model(req.model)
    stored = req.store is not False and store.enabled
    head = {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()), "model": model,
            **echo(req, stored)}
    usage = Usage()
    builder = ResponseBuilder(head, make_parser, usage)

    def keep() -> None:
        if stored and builder.status != "failed":
            response = builder.response()
            outputs = output_as_input(response["output"])
            size = previous_bytes + items_bytes(new_items) + items_bytes(outputs)
            store.put(Stored(response, (*items, *outputs), size))

    async def opening() -> list[GenerateStream]:
        with responses_names():
            return await client.open_streams([pb])

    if req.stream:
        # Keepalive comments while the request waits for its first output (sse.open_and_stream);
        # an error reported after the response started is the spec's response.failed.
        def failed(exc: GatewayError) -> list[bytes]:
            return [frame(e) for e in (*builder.start(), *builder.fail(renamed(exc)))]

        return await sse.open_and_stream(
            request, opening(), lambda streams: _events(streams, builder, usage, keep), failed)
    streams = await sse.unless_disconnected(request, opening())

    async def run() -> None:
        reason = None
        try:
            async for u in updates(streams, 1, usage):
                builder.feed(u)
                reason = u.finish_reason
        finally:
            for stream in streams:
                stream.cancel()
        builder.finish(reason)

    with responses_names():
        await sse.unless_disconnected(request, run())
    keep()
    return sse.json_response(builder.response())


def _no_query(request: Request) -> None:
    """GET and DELETE take no query parameters here (OpenAI's ``stream``, ``include`` and
    ``starting_after`` are not served): one given is refused by name."""
    for name in request.query_params:
        raise invalid(f"the query parameter '{name}' is not supported", name, "unsupported_parameter")


def router(config: GatewayConfig) -> APIRouter:
    """The routes, over one response store for this gateway process."""
    store = ResponseStore(config.responses_store_max, config.responses_store_max_bytes)
    api = APIRouter(route_class=BodyRoute)

    @api.post("/v1/responses", responses=schemas.ok(ResponseObject, stream=True))
    async def create(body: ResponsesRequest, request: Request) -> Response:
        return await create_response(request.app.state.client, request, body, config, store)

    @api.get("/v1/responses/{response_id}", responses=schemas.ok(ResponseObject))
    async def retrieve(response_id: str, request: Request) -> Response:
        _no_query(request)
        entry = store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        return sse.json_response(entry.response)

    @api.delete("/v1/responses/{response_id}", responses=schemas.ok(DeletedResponse))
    async def delete(response_id: str, request: Request) -> Response:
        _no_query(request)
        if not store.delete(response_id):
            raise not_found(response_id)
        return sse.json_response({"id": response_id, "object": "response", "deleted": True})

    return api
