"""``POST /v1/embeddings`` (OpenAI's Embeddings API) over the tokenizer's ``Embed`` RPC.

``input`` is a string, a list of strings, a list of token ids or a list of lists of ids (at
most 2048 inputs, OpenAI's limit; an empty one, or one longer than the context, is a 400 naming
``input``). ``encoding_format`` ``float`` gives each embedding as a list of numbers, ``base64``
as the base64 of its little-endian float32 bytes (what the openai SDK asks for by default and
decodes). ``dimensions`` is honoured only for a model that declares Matryoshka dimensions, else
refused by name; ``user`` is accepted and not used. The vectors are the scheduler's pooled
final hidden states (services/scheduler/executor/pooling.py).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.responses import Response

from ringserve import tracing
from ringserve.v1 import tokenizer_pb2

from . import request_context, schemas, sse
from .backend import TokenizerClient
from .body import BodyRoute
from .errors import invalid
from .protocol import INT32_MAX, Body, JsonInt, NonNegInt

# Inputs per request (OpenAI's limit); the tokenizer refuses more with the same message.
MAX_INPUTS = 2048


class EmbeddingRequest(Body):
    """``POST /v1/embeddings``."""

    model: str | None = None
    input: str | list[str] | list[NonNegInt] | list[list[NonNegInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: JsonInt | None = Field(None, ge=1, le=INT32_MAX)
    user: str | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # a list of floats, or base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def embed_request(body: EmbeddingRequest) -> tokenizer_pb2.EmbedRequest:
    """The Embed RPC's request for ``body``.

    Raises:
        GatewayError(400): no input, more than MAX_INPUTS, or an empty string or id list
            (param "input").
    """
    given = body.input
    # One text or one list of ids is one input.
    items: list = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else list(given)
    if not items:
        raise invalid("input must not be empty", "input")
    if len(items) > MAX_INPUTS:
        raise invalid(f"input holds {len(items)} inputs; at most {MAX_INPUTS} are allowed", "input")
    pb = tokenizer_pb2.EmbedRequest(dimensions=body.dimensions or 0)
    for i, item in enumerate(items):
        where = f"input[{i}]" if len(items) > 1 else "input"
        if not item:
            raise invalid(f"{where} is empty", "input")
        if isinstance(item, str):
            pb.inputs.add(text=item)
        else:
            pb.inputs.add().input_ids.ids.extend(item)
    return pb


def encode(values: Sequence[float], encoding_format: str) -> list[float] | str:
    """One embedding as the response carries it: the floats, or base64 of their float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
    return list(values)


async def create_embeddings(client: TokenizerClient, request: Request, body: EmbeddingRequest) -> Response:
    """Serve ``POST /v1/embeddings``; a client that leaves cancels the call (the inputs are aborted).

    Raises:
        GatewayError: 400 for bad input (here or from the tokenizer), 404 for another model,
            the tokenizer's status otherwise.
        ClientDisconnected: the client went away first.
    """
    model, lora_name = await client.resolve_model(body.model)
    if lora_name:
        raise invalid(f"embeddings are not served under a LoRA adapter ('{lora_name}'); name the base model", "model")
    pb = embed_request(body)
    pb.rid = request_context.adopt(None, lambda: {tracing.GEN_AI_OPERATION: "embeddings",
                                                  tracing.GEN_AI_REQUEST_MODEL: body.model})
    resp = await sse.unless_disconnected(request, client.embed(pb))
    data = [{"object": "embedding", "index": i, "embedding": encode(e.values, body.encoding_format)}
            for i, e in enumerate(resp.embeddings)]
    usage = {"prompt_tokens": resp.prompt_tokens, "total_tokens": resp.prompt_tokens}
    return sse.json_response({"object": "list", "data": data, "model": model, "usage": usage})


router = APIRouter(route_class=BodyRoute)  # bounded JSON decoding, as every route (body.py)


@router.post("/v1/embeddings", responses=schemas.ok(EmbeddingResponse))
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    return await create_embeddings(request.app.state.client, request, body)
