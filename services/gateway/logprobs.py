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

from ringserve.v1 import common_pb2, tokenizer_pb2

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
        {**entry(t, lp), "top_logprobs": [entry(tt, tlp) for tt, tlp in zip(top.token_ids, top.logprobs, strict=True)]}
        for t, lp, top in zip(out.output_ids, out.output_token_logprobs, _tops(out), strict=True)
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
        tops = [{pieces[t].text: lp for t, lp in zip(top.token_ids, top.logprobs, strict=True)} for top in _tops(out)]
    return {
        "tokens": tokens,
        "token_logprobs": list(out.output_token_logprobs),
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _prompt(out: tokenizer_pb2.GenerateOutput) -> common_pb2.PromptLogprobs | None:
    return out.prompt_logprobs if out.HasField("prompt_logprobs") else None


def _prompt_rows(p: common_pb2.PromptLogprobs) -> list[tuple[int, float | None, list[tuple[int, float]]]]:
    """(token id, logprob or None, [(top id, top logprob)]) per prompt token from the
    requested start; the tokens before the first scored position (position 0) have None."""
    unscored = len(p.token_ids) - len(p.logprobs)
    rows: list[tuple[int, float | None, list[tuple[int, float]]]] = [(t, None, []) for t in p.token_ids[:unscored]]
    k = p.top_n
    for j, (t, lp) in enumerate(zip(p.token_ids[unscored:], p.logprobs, strict=True)):
        rows.append((t, lp, list(zip(p.top_ids[j * k : (j + 1) * k], p.top_vals[j * k : (j + 1) * k], strict=True))))
    return rows


async def echo_logprobs(client: TokenizerClient, out: tokenizer_pb2.GenerateOutput, want_top: bool) -> dict | None:
    """Completions ``logprobs`` entries of the echoed prompt (OpenAI's ``echo`` with
    ``logprobs``): one per prompt token, the first with a null logprob (and null top
    logprobs), text offsets from 0. None when ``out`` carries no prompt logprobs."""
    p = _prompt(out)
    if p is None:
        return None
    rows = _prompt_rows(p)
    pieces = await client.token_pieces([t for t, _, _ in rows] + list(p.top_ids))
    tokens = [pieces[t].text for t, _, _ in rows]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    tops = None
    if want_top:
        tops = [None if lp is None else {pieces[i].text: v for i, v in top} for _, lp, top in rows]
    return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in rows], "top_logprobs": tops, "text_offset": offsets}


def join_completion_logprobs(prompt: dict | None, output: dict | None) -> dict | None:
    """The echoed prompt's entries followed by the generated tokens' ones (same keys;
    ``top_logprobs`` is null in both or in neither)."""
    if prompt is None or output is None:
        return prompt or output
    return {key: None if prompt[key] is None else prompt[key] + output[key] for key in prompt}


async def vllm_prompt_logprobs(client: TokenizerClient, out: tokenizer_pb2.GenerateOutput) -> list | None:
    """vLLM's ``prompt_logprobs``: per prompt token ``None`` (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` for the token and its top-k (rank
    among the top-k, 1-based; null for a prompt token outside them)."""
    p = _prompt(out)
    if p is None:
        return None
    rows = _prompt_rows(p)
    pieces = await client.token_pieces([t for t, _, _ in rows] + list(p.top_ids))
    result: list = []
    for t, lp, top in rows:
        if lp is None:
            result.append(None)
            continue
        ranks = {i: r for r, (i, _) in enumerate(top, 1)}
        entry = {str(t): {"logprob": lp, "rank": ranks.get(t), "decoded_token": pieces[t].text}}
        for i, v in top:
            entry.setdefault(str(i), {"logprob": v, "rank": ranks[i], "decoded_token": pieces[i].text})
        result.append(entry)
    return result


def sglang_input_logprobs(out: tokenizer_pb2.GenerateOutput) -> dict:
    """SGLang's ``input_token_logprobs`` / ``input_top_logprobs`` meta_info fields:
    ``[logprob, token_id, None]`` triples (logprob None for position 0)."""
    p = _prompt(out)
    if p is None:
        return {}
    rows = _prompt_rows(p)
    return {
        "input_token_logprobs": [[lp, t, None] for t, lp, _ in rows],
        "input_top_logprobs": [None if lp is None else [[v, i, None] for i, v in top] for _, lp, top in rows],
    }
