"""Logprobs in the OpenAI shapes, from a GenerateOutput's ids and aligned logprobs.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
Completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.

One entry per token id of the output, however many tokens one output (one SSE chunk)
carries. Token strings and bytes come from the tokenizer service in one ``TokenPieces``
call per output (``TokenizerClient.token_pieces``, cached per id). A token that is part of
a multi-byte character decodes to U+FFFD on its own, as in vLLM; its ``bytes`` are the
token's real bytes (as OpenAI gives them), so concatenated bytes rebuild the text.
``text_offset`` counts characters of the choice's text (echo included) at which each token
starts, from the token strings (as vLLM does).
"""

from __future__ import annotations

from ringserve.v1 import tokenizer_pb2

from .backend import TokenizerClient, TokenPiece


async def _pieces(client: TokenizerClient, out: tokenizer_pb2.GenerateOutput) -> dict[int, TokenPiece]:
    ids = list(out.output_ids)
    for top in out.output_top_logprobs:
        ids.extend(top.token_ids)
    return await client.token_pieces(ids)


def _tops(out: tokenizer_pb2.GenerateOutput) -> list[tokenizer_pb2.TopLogprobs]:
    tops = list(out.output_top_logprobs)
    return tops + [tokenizer_pb2.TopLogprobs()] * (len(out.output_ids) - len(tops))


async def chat_logprobs(client: TokenizerClient, out: tokenizer_pb2.GenerateOutput) -> dict | None:
    """The chat ``logprobs`` object of the tokens in ``out``; None when none were returned."""
    if not out.output_token_logprobs:
        return None
    pieces = await _pieces(client, out)

    def entry(token_id: int, logprob: float) -> dict:
        p = pieces[token_id]
        return {"token": p.text, "logprob": logprob, "bytes": list(p.raw)}

    content = [
        {**entry(t, lp), "top_logprobs": [entry(tt, tlp) for tt, tlp in zip(top.token_ids, top.logprobs)]}
        for t, lp, top in zip(out.output_ids, out.output_token_logprobs, _tops(out))
    ]
    return {"content": content}


async def completion_logprobs(
    client: TokenizerClient, out: tokenizer_pb2.GenerateOutput, text_offset: int, want_top: bool
) -> dict | None:
    """The completions ``logprobs`` object; ``text_offset`` is where this output's text starts
    in the choice's text (characters). ``top_logprobs`` is null when ``logprobs`` was 0."""
    if not out.output_token_logprobs:
        return None
    pieces = await _pieces(client, out)
    tokens = [pieces[t].text for t in out.output_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    tops = None
    if want_top:
        tops = [{pieces[t].text: lp for t, lp in zip(top.token_ids, top.logprobs)} for top in _tops(out)]
    return {
        "tokens": tokens,
        "token_logprobs": list(out.output_token_logprobs),
        "top_logprobs": tops,
        "text_offset": offsets,
    }
