"""Cases C03 and C04 of docs/cases.md: stop strings, through the running stack.

Every expectation comes from the model's own unstopped greedy output, read as token ids
through the gRPC API: the stop ends the text at the first step whose decoded output holds
it, and the text is cut before that occurrence. Each variant runs three ways at once: HTTP
streamed, HTTP not streamed, and gRPC streamed (which carries the ids of each delta, so the
text held back at every step is checked exactly).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import httpx
import pytest
from tokenizers import Tokenizer

from ringserve.client import AsyncRingserveClient, chat_request, text_request
from tests.helpers.sse_reader import call

COUNTING = "Counting upward by ones, separated by spaces: 1 2 3"
RIVERS = "Write three short paragraphs about rivers, separated by blank lines.\n\n"


@pytest.fixture(scope="module")
def tok(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


def first_stop(tok: Tokenizer, ids: list[int], stops: list[str], min_tokens: int = 0) -> tuple[str, str | None, int]:
    """(text, matched stop, tokens generated) that ``stops`` make of the greedy output ``ids``.

    A stop counts from the ``min_tokens``-th token on, and only an occurrence that the
    newest token completes (one seen earlier, below min_tokens, is output text).
    """
    for k in range(max(1, min_tokens), len(ids) + 1):
        text, before = tok.decode(ids[:k]), tok.decode(ids[: k - 1])
        hits = [(at, s) for s in stops if (at := text.find(s, max(0, len(before) - len(s) + 1))) >= 0]
        if hits:
            at, stop = min(hits)
            return text[:at], stop, k
    return tok.decode(ids), None, len(ids)


def held_back(text: str, stops: list[str]) -> str:
    """The longest suffix of ``text`` that is a proper prefix of a stop: exactly what may be held."""
    for p in range(max(0, len(text) - max(map(len, stops)) + 1), len(text)):
        if any(len(s) > len(text) - p and s.startswith(text[p:]) for s in stops):
            return text[p:]
    return ""


class Prompt:
    """A prompt sent to one endpoint, as an HTTP body and as a gRPC request."""

    def __init__(self, model: str, prompt: str, chat: bool):
        self.model, self.prompt, self.chat = model, prompt, chat

    def body(self, stream: bool, max_tokens: int, stops: list[str] | None, min_tokens: int = 0) -> dict:
        key = {"messages": [{"role": "user", "content": self.prompt}]} if self.chat else {"prompt": self.prompt}
        return {"model": self.model, **key, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
                "stop": stops, "min_tokens": min_tokens}

    def grpc(self, stream: bool, max_tokens: int, stops: list[str], min_tokens: int = 0):
        kwargs = dict(stream=stream, max_new_tokens=max_tokens, temperature=0.0, stop=stops,
                      min_new_tokens=min_tokens)
        if self.chat:
            return chat_request([{"role": "user", "content": self.prompt}], **kwargs)
        return text_request(self.prompt, **kwargs)


@dataclass(frozen=True)
class Greedy:
    """The unstopped greedy output: its ids and how it ended."""

    ids: list[int]
    finish_reason: str
    matched_stop: int | None  # the EOS id when the model ended its turn


async def greedy(grpc: AsyncRingserveClient, prompt: Prompt, max_tokens: int) -> Greedy:
    final = [c async for c in grpc.generate(prompt.grpc(False, max_tokens, []))][-1]
    return Greedy(list(final.output_ids), final.finish_reason, final.matched_stop)


async def grpc_stream_text(grpc: AsyncRingserveClient, tok: Tokenizer, prompt: Prompt, max_tokens: int,
                           stops: list[str], min_tokens: int) -> tuple[str, str | None, str | int | None]:
    """Stream over gRPC, checking after every delta that what is held back is exactly the
    longest suffix that could still grow into a stop (at most len(longest) - 1 characters)."""
    ids: list[int] = []
    sent = ""
    async for chunk in grpc.generate(prompt.grpc(True, max_tokens, stops, min_tokens)):
        ids += chunk.output_ids
        sent += chunk.text
        if chunk.finish_reason is None:
            decoded = tok.decode(ids)
            held = held_back(decoded, stops)
            assert sent + held == decoded, (stops, sent, decoded)
            assert len(held) <= max(map(len, stops)) - 1
    return sent, chunk.finish_reason, chunk.matched_stop


async def check_variants(stack, tok: Tokenizer, prompt: Prompt, max_tokens: int, ref: Greedy,
                         variants: list[list[str]], min_tokens: int = 0) -> None:
    """Each stop list, streamed and not, over HTTP and gRPC, concurrently; exact text, finish
    reason and matched stop; no streamed prefix ever runs past the final text."""
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client, \
            AsyncRingserveClient(stack.tokenizer) as grpc:
        runs = [(stops, kind) for stops in variants for kind in ("stream", "full", "grpc")]

        def run(stops: list[str], kind: str):
            if kind == "grpc":
                return grpc_stream_text(grpc, tok, prompt, max_tokens, stops, min_tokens)
            return call(client, prompt.body(kind == "stream", max_tokens, stops, min_tokens))

        results = await asyncio.gather(*(run(stops, kind) for stops, kind in runs))
    for (stops, kind), got in zip(runs, results, strict=True):
        text, matched, _ = first_stop(tok, ref.ids, stops, min_tokens)
        want = (text, "stop", matched) if matched else (text, ref.finish_reason, ref.matched_stop)
        if kind == "grpc":
            assert got == want, (stops, kind)
            continue
        choice = got.only
        assert (choice.text, choice.finish_reason, choice.matched_stop) == want, (stops, kind)
        streamed = ""
        for delta in choice.deltas:
            streamed += delta
            assert text.startswith(streamed), (stops, streamed)  # nothing of the stop leaks
    stack.wait_idle()


async def test_c03_start_of_stop_string_never_leaks(stack, tok):
    prompt = Prompt(stack.model_name, COUNTING, chat=False)
    say_hi = Prompt(stack.model_name, "Say hi.", chat=True)
    async with AsyncRingserveClient(stack.tokenizer) as grpc:
        ref, hi = await asyncio.gather(greedy(grpc, prompt, 40), greedy(grpc, say_hi, 40))
    ids = ref.ids
    full = tok.decode(ids)
    assert full.startswith(" 4 5 6 7 8 9 10") and ref.finish_reason == "length"
    variants = [
        [" 4 5 6 7"],  # the case itself: the whole output is held, then cut to ""
        [" 4 5 6 8"],  # " 4 5 6" is held, then released when " 7" rules the match out
        [" 9 1", " 7 8 9 10 11 12"],  # the shorter stop matches first; hold up to 14 chars
        [full[-3:] + "|"],  # the output ends on a stop prefix: released at the length finish
    ]
    assert [first_stop(tok, ids, v)[1] for v in variants] == [" 4 5 6 7", None, " 9 1", None]
    await check_variants(stack, tok, prompt, 40, ref, variants)
    # Below min_tokens a stop is output text, and it stays so: " 4" (tokens " ", "4") is seen
    # at the 2nd token and never again; " 5" completes at the 4th, the first that may stop.
    min_variants = [[" 4"], [" 5"]]
    assert [first_stop(tok, ids, v, 4)[:2] for v in min_variants] == [(full, None), (" 4", " 5")]
    await check_variants(stack, tok, prompt, 40, ref, min_variants, min_tokens=4)
    # The answer ends on a stop prefix and the model ends its turn: released at the EOS finish.
    assert (hi.finish_reason, hi.matched_stop) == ("stop", 2)
    await check_variants(stack, tok, say_hi, 40, hi, [[tok.decode(hi.ids)[-3:] + "|"]])


def token_texts(tok: Tokenizer, ids: list[int]) -> tuple[list[str], list[int]]:
    """Each token's text and character offset inside the decoded output (ASCII output)."""
    prefixes = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
    assert all(b.startswith(a) for a, b in pairwise(prefixes))
    return [b[len(a):] for a, b in pairwise(prefixes)], [len(p) for p in prefixes[:-1]]


def place_stop(tok: Tokenizer, ids: list[int], make: Callable[[list[str], int], str | None],
               span: int, skip: int) -> str:
    """The first stop ``make(texts, k)`` whose first occurrence starts ``skip`` characters
    into token k and completes in token k + span - 1, ending inside it."""
    texts, offsets = token_texts(tok, ids)
    for k in range(1, len(ids) - span):
        stop = make(texts, k)
        if not stop:
            continue
        text, matched, n = first_stop(tok, ids, [stop])
        last = k + span - 1
        ends_inside = offsets[k] + skip + len(stop) < offsets[last] + len(texts[last])
        if (len(text), matched, n) == (offsets[k] + skip, stop, last + 1) and ends_inside:
            return stop
    raise AssertionError("the greedy output has no place for this stop")


def c04_variants(tok: Tokenizer, ids: list[int]) -> list[list[str]]:
    def long(t: str, n: int) -> bool:
        return len(t.strip()) >= n

    # A stop that ends inside a token (" rive" when the model emits " rivers").
    inside = place_stop(tok, ids, lambda t, k: t[k][:-1] if long(t[k], 4) else None, 1, 0)
    # One that spans three tokens, starting and ending inside tokens.
    across = place_stop(tok, ids, lambda t, k: t[k][1:] + t[k + 1] + t[k + 2][:-1]
                        if long(t[k], 2) and long(t[k + 2], 2) else None, 3, 1)
    # One that shares its token with other text on both sides.
    shared = place_stop(tok, ids, lambda t, k: t[k][1:-1] if long(t[k], 4) else None, 1, 1)
    return [[inside], [across], [shared, "never-in-the-output"]]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_c04_stop_strings_independent_of_token_boundaries(stack, tok, chat):
    prompt = Prompt(stack.model_name, RIVERS, chat)
    async with AsyncRingserveClient(stack.tokenizer) as grpc:
        ref = await greedy(grpc, prompt, 40)
    ids = ref.ids
    variants = c04_variants(tok, ids)
    if not chat:
        # The case itself: "\n\n" first comes as two "\n" tokens (later as one "\n\n" token).
        _, matched, n = first_stop(tok, ids, ["\n\n"])
        assert matched == "\n\n" and token_texts(tok, ids)[0][n - 2 : n] == ["\n", "\n"]
        await check_variants(stack, tok, prompt, 300, ref, [["\n\n"]])
    await check_variants(stack, tok, prompt, 40, ref, variants)
