"""SGLang's native endpoints: ``POST /generate`` and ``POST /abort_request``.

``/generate`` answers with ``{"text", "output_ids", "meta_info"}`` (a list of them when
``n > 1``). Streamed, each event carries one choice's *new* text and ids (deltas, like the
OpenAI endpoints), and the stream ends with ``data: [DONE]``.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from ringserve.v1 import tokenizer_pb2

from . import convert, sse
from .backend import TokenizerClient
from .errors import GatewayError
from .logprobs import sglang_input_logprobs
from .outputs import ChoiceUpdate, FinalChoice, Usage, collect, sse_events
from .protocol import AbortRequest, GenerateRequest


def _finish(reason: str | None, matched: str | int | None, out: tokenizer_pb2.GenerateOutput) -> dict | None:
    if reason is None:
        return None
    finish: dict = {"type": reason, "matched": matched}
    if reason == "length":
        finish["length"] = out.completion_tokens
    if reason == "abort":
        finish["message"] = out.finish_reason.message
    return finish


def _result(rid: str, index: int, text: str, finish: dict | None, out: tokenizer_pb2.GenerateOutput) -> dict:
    return {"text": text, "output_ids": list(out.output_ids), "meta_info": _meta(rid, index, finish, out)}


def _meta(rid: str, index: int, finish: dict | None, out: tokenizer_pb2.GenerateOutput) -> dict:
    """SGLang's meta_info; logprobs as SGLang gives them: [logprob, token_id, None] triples."""
    meta = {
        "id": rid,
        "index": index,
        "finish_reason": finish,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
    }
    meta.update(sglang_input_logprobs(out))
    if out.output_token_logprobs:
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(out.output_token_logprobs, out.output_ids, strict=True)
        ]
        meta["output_top_logprobs"] = [
            [[lp, t, None] for t, lp in zip(top.token_ids, top.logprobs, strict=True)]
            for top in out.output_top_logprobs
        ]
    return meta


async def generate(client: TokenizerClient, request: Request, req: GenerateRequest) -> Response:
    """Serve ``/generate``.

    Raises:
        GatewayError: validation (400) or tokenizer errors (mapped).
        ClientDisconnected: the client went away before the response started.
    """
    rid = convert.new_rid(req)
    pb = convert.native_request(req, rid)
    if req.lora_path is not None:  # SGLang's name for the adapter a request runs under
        pb.lora_name = (await client.resolve_model(req.lora_path))[1]
    n = req.sampling_params.n or 1
    usage = Usage()
    if req.stream:
        async def event_of(u: ChoiceUpdate) -> dict:
            finish = _finish(u.finish_reason, u.matched_stop, u.out)
            return _result(rid, u.index, u.text, finish, u.out)

        return await sse.open_and_stream(request, client.open_stream(pb),
                                         lambda stream: sse_events([stream], n, usage, event_of))

    async def run() -> list[FinalChoice]:
        return await collect(await client.open_streams([pb]), n, usage)

    results = []
    for c in await sse.unless_disconnected(request, run()):
        finish = _finish(c.finish_reason, c.matched_stop, c.out)
        results.append(_result(rid, c.index, c.text, finish, c.out))
    return sse.json_response(results[0] if n == 1 and len(results) == 1 else results)


async def abort_request(client: TokenizerClient, req: AbortRequest) -> Response:
    """Abort an in-flight rid; 404 when the tokenizer does not know it."""
    resp = await client.unary("Abort", tokenizer_pb2.AbortRequest(rid=req.rid))
    if not resp.found:  # type: ignore[attr-defined]
        message = f"no request with rid '{req.rid}' is in flight"
        raise GatewayError(message, 404, "not_found_error", "rid", "not_found")
    return sse.json_response({"rid": req.rid, "aborted": True})
