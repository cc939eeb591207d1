"""``POST /v1/completions``: text_completion bodies or streams, for one prompt or a batch.

A batch (list of strings or of id lists) runs one ``Generate`` call per prompt; choice
``j`` of prompt ``i`` is reported as index ``i * n + j``. ``echo`` prepends the prompt text
(decoded by the tokenizer service when the prompt is token ids) to each choice's text;
with ``logprobs`` its tokens get logprob entries too (computed by the scheduler during
prefill; the first token's is null, as OpenAI's), and ``max_tokens: 0`` scores the prompt
without generating. vLLM's ``prompt_logprobs: k`` adds each choice's ``prompt_logprobs``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from starlette.requests import Request
from starlette.responses import Response

from ringserve.v1 import tokenizer_pb2

from . import convert
from .backend import TokenizerClient
from .logprobs import completion_logprobs, echo_logprobs, join_completion_logprobs, vllm_prompt_logprobs
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


async def _logprobs(client: TokenizerClient, out: tokenizer_pb2.GenerateOutput, echoed: bool, offset: int,
                    want_top: bool) -> dict | None:
    """The choice's ``logprobs``: the echoed prompt's tokens first (once), then the output's."""
    prompt = await echo_logprobs(client, out, want_top) if echoed else None
    return join_completion_logprobs(prompt, await completion_logprobs(client, out, offset, want_top))


def _text_choice(
    client: TokenizerClient, echoes: Sequence[str], want_logprobs: bool, want_top: bool, echo: bool
) -> Callable[[ChoiceUpdate], Awaitable[dict | None]]:
    sent: dict[int, int] = {}  # choice index -> characters sent, for text_offset

    async def choice_of(u: ChoiceUpdate) -> dict | None:
        echo_text = echoes[u.prompt_index] if u.first else ""
        text = echo_text + u.text
        if not text and u.finish_reason is None and not (want_logprobs and u.out.output_ids):
            return None
        offset = sent.get(u.index, 0) + len(echo_text)
        sent[u.index] = offset + len(u.text)
        logprobs = await _logprobs(client, u.out, echo and u.first, offset, want_top) if want_logprobs else None
        return {
            "index": u.index,
            "text": text,
            "logprobs": logprobs,
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
    model, lora_name = await client.resolve_model(req.model)
    for pb in pbs:
        pb.lora_name = lora_name
    echoes = await _echo_texts(client, pbs) if req.echo else [""] * len(pbs)
    want_logprobs = req.logprobs is not None
    want_top = bool(req.logprobs)

    async def final_choice(c: FinalChoice) -> dict:
        echo = echoes[c.prompt_index]
        choice = {
            "index": c.index,
            "text": echo + c.text,
            "logprobs": await _logprobs(client, c.out, req.echo, len(echo), want_top) if want_logprobs else None,
            "finish_reason": c.finish_reason,
            "matched_stop": c.matched_stop,
        }
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = await vllm_prompt_logprobs(client, c.out)
        return choice

    return await respond(
        client,
        request,
        pbs,
        req.n or 1,
        response_head("cmpl", rid, model),
        ("text_completion", "text_completion"),
        req.stream_options,
        _text_choice(client, echoes, want_logprobs, want_top, req.echo),
        final_choice,
    )
