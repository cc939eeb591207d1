"""The request flow shared by the OpenAI endpoints: open the Generate calls, then either
stream chunks or wait for every choice and build one body.

Both paths race the work against the client going away (``sse.unless_disconnected``), so
a disconnect at any point cancels the gRPC calls.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from starlette.requests import Request
from starlette.responses import Response

from ringserve.v1 import tokenizer_pb2

from . import sse
from .backend import TokenizerClient
from .outputs import ChoiceUpdate, FinalChoice, Usage, collect, sse_chunks
from .protocol import StreamOptions

SYSTEM_FINGERPRINT = "ringserve-v1"


def response_head(id_prefix: str, rid: str, model: str) -> dict:
    """Fields every body and chunk of one request shares."""
    return {"id": f"{id_prefix}-{rid}", "created": int(time.time()), "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT}


async def respond(
    client: TokenizerClient,
    request: Request,
    pbs: Sequence[tokenizer_pb2.GenerateReqInput],
    n: int,
    head: dict,
    objects: tuple[str, str],
    stream_options: StreamOptions | None,
    choice_of: Callable[[ChoiceUpdate], Awaitable[dict | None]],
    final_choice: Callable[[FinalChoice], Awaitable[dict]],
    body_extra: Callable[[list[FinalChoice]], Awaitable[dict]] | None = None,
) -> Response:
    """Serve generation requests ``pbs`` (n choices each) as an OpenAI response.

    Args:
        objects: the ``object`` of the non-stream body and of a stream chunk.
        choice_of: a stream update -> one chunk choice (None: send nothing).
        final_choice: a finished choice -> its entry in the body.
        body_extra: the finished choices -> more top-level fields of the body.

    Raises:
        GatewayError: anything the tokenizer reports before the first output (a stream:
            within the first keepalive interval, see ``sse.open_and_stream``).
        ClientDisconnected: the client went away before the response started.
    """
    usage = Usage()
    body_object, chunk_object = objects
    if pbs[0].stream:
        chunk_head = {**head, "object": chunk_object}
        return await sse.open_and_stream(
            request, client.open_streams(pbs),
            lambda streams: sse_chunks(streams, chunk_head, n, usage, choice_of, stream_options))

    async def run() -> list[FinalChoice]:
        return await collect(await client.open_streams(pbs), n, usage)

    finals = await sse.unless_disconnected(request, run())
    choices = [await final_choice(c) for c in finals]
    extra = await body_extra(finals) if body_extra is not None else {}
    return sse.json_response({**head, "object": body_object, "choices": choices, "usage": usage.to_dict(), **extra})
