"""Logprobs in the OpenAI shapes, from a GenerateOutput's ids and aligned logprobs.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
Completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``.
Token strings come from the tokenizer service (``TokenizerClient.token_texts``); a token
that is part of a multi-byte character decodes to U+FFFD on its own, as in vLLM.
"""

from __future__ import annotations

from ringserve.v1 import tokenizer_pb2

from .backend import TokenizerClient


async def _texts(client: TokenizerClient, out: tokenizer_pb2.GenerateOutput) -> dict[int, str]:
    ids = list(out.output_ids)
    for top in out.output_top_logprobs:
        ids.extend(top.token_ids)
    return await client.token_texts(ids)


async def chat_logprobs(client: TokenizerClient, out: tokenizer_pb2.GenerateOutput) -> dict | None:
    """The chat ``logprobs`` object of the tokens in ``out``; None when none were returned."""
    if not out.output_token_logprobs:
        return None
    texts = await _texts(client, out)
    tops = list(out.output_top_logprobs)
    content = []
    for i, (token_id, logprob) in enumerate(zip(out.output_ids, out.output_token_logprobs)):
        top = tops[i] if i < len(tops) else tokenizer_pb2.TopLogprobs()
        content.append(
            {
                "token": texts[token_id],
                "logprob": logprob,
                "bytes": list(texts[token_id].encode()),
                "top_logprobs": [
                    {"token": texts[t], "logprob": lp, "bytes": list(texts[t].encode())}
                    for t, lp in zip(top.token_ids, top.logprobs)
                ],
            }
        )
    return {"content": content}


async def completion_logprobs(
    client: TokenizerClient, out: tokenizer_pb2.GenerateOutput, text_offset: int
) -> dict | None:
    """The completions ``logprobs`` object; ``text_offset`` is where this output's text starts
    in the choice's text (characters)."""
    if not out.output_token_logprobs:
        return None
    texts = await _texts(client, out)
    tops = list(out.output_top_logprobs)
    tokens = [texts[t] for t in out.output_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": list(out.output_token_logprobs),
        "top_logprobs": [
            {texts[t]: lp for t, lp in zip(top.token_ids, top.logprobs)} for top in tops
        ] if tops else None,
        "text_offset": offsets,
    }
