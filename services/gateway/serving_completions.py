"""``POST /v1/completions``: text_completion bodies or streams, for one prompt or a batch.

A batch (list of strings or of id lists) runs one ``Generate`` call per prompt; choice
``j`` of prompt ``i`` is reported as index ``i * n + j``. ``echo`` prepends the prompt text
(decoded by the tokenizer service when the prompt is token ids) to each choice's text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from starlette.requests import Request
from starlette.responses import Response

from ringserve.v1 import tokenizer_pb2

from . import convert
from .backend import TokenizerClient
from .logprobs import completion_logprobs
from .outputs import ChoiceUpdate, FinalChoice
from .protocol import CompletionRequest
from .serving import respond, response_head


async def _echo_texts(client: TokenizerClient, reqs: Sequence[tokenizer_pb2.GenerateReqInput]) -> list[str]:
    async def text_of(pb: tokenizer_pb2.GenerateReqInput) -> str:
        if pb.WhichOneof("input") == "text":
            return pb.text
        resp = await client.unary("Detokenize", tokenizer_pb2.DetokenizeRequest(ids=pb.input_ids.ids))
        return resp.text  # type: ignore[attr-defined]

    return list(await asyncio.gather(*(text_of(pb) for pb in reqs)))


def _text_choice(
    client: TokenizerClient, echoes: Sequence[str], want_logprobs: bool, want_top: bool
) -> Callable[[ChoiceUpdate], Awaitable[dict | None]]:
    sent: dict[int, int] = {}  # choice index -> characters sent, for text_offset

    async def choice_of(u: ChoiceUpdate) -> dict | None:
        echo = echoes[u.prompt_index] if u.first else ""
        text = echo + u.text
        if not text and u.finish_reason is None and not (want_logprobs and u.out.output_ids):
            return None
        offset = sent.get(u.index, 0) + len(echo)
        sent[u.index] = offset + len(u.text)
        return {
            "index": u.index,
            "text": text,
            "logprobs": await completion_logprobs(client, u.out, offset, want_top) if want_logprobs else None,
            "finish_reason": u.finish_reason,
            "matched_stop": u.matched_stop,
        }

    return choice_of


async def create_completion(client: TokenizerClient, request: Request, req: CompletionRequest) -> Response:
    """Serve one completions request; every error before the first output is a JSON error.

    Raises:
        GatewayError: validation (400), unknown model (404), tokenizer errors (mapped).
        ClientDisconnected: the client went away before the response started.
    """
    rid = convert.new_rid(req)
    pbs = convert.completion_requests(req, rid)
    model = await client.check_model(req.model)
    echoes = await _echo_texts(client, pbs) if req.echo else [""] * len(pbs)
    want_logprobs = req.logprobs is not None
    want_top = bool(req.logprobs)

    async def final_choice(c: FinalChoice) -> dict:
        echo = echoes[c.prompt_index]
        return {
            "index": c.index,
            "text": echo + c.text,
            "logprobs": await completion_logprobs(client, c.out, len(echo), want_top) if want_logprobs else None,
            "finish_reason": c.finish_reason,
            "matched_stop": c.matched_stop,
        }

    return await respond(
        client,
        request,
        pbs,
        req.n or 1,
        response_head("cmpl", rid, model),
        ("text_completion", "text_completion"),
        req.stream_options,
        _text_choice(client, echoes, want_logprobs, want_top),
        final_choice,
    )
