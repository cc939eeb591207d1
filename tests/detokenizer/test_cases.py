"""Component forms of acceptance cases C01-C04 (docs/cases.md), plus a stop-string
property test: the detokenizer holds exactly the stop prefixes and trims the matched stop."""

from __future__ import annotations

import random

import pytest

from ringserve.v1 import common_pb2
from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.replay import StreamSpec, build_steps, collect
from tests.helpers.detok_streams import Case, chunked, common_prefix_len, decided_positions
from tests.helpers.textgen import generate
from tests.helpers.vocabs import VOCABS

C01 = "社区非常活跃，鼠标与键盘 — 삼겹살 — ďábelské — 👩‍💻 🇯🇵 👍🏽 café"
C02 = "This engine serves LLMs. It is fast. Don't stop — it's fine.  Two spaces here."


def stream(manager: DetokenizerManager, spec: StreamSpec) -> list[str]:
    """Deltas of one request, one per step."""
    deltas: dict[str, list[str]] = {}
    for batch in build_steps([spec]):
        collect(manager.handle_batch(batch), deltas)
    assert manager.num_decode_states == 0
    return deltas[spec.rid]


def stop_finish(matched: str) -> common_pb2.FinishReason:
    return common_pb2.FinishReason(type=common_pb2.FINISH_STOP, matched_str=matched)


@pytest.mark.parametrize("vocab", ["smollm2", "qwen25"])
@pytest.mark.parametrize("fast", [True, False])
def test_c01_split_multibyte_characters(vocab, fast, tokenizers, make_manager):
    tok = tokenizers[vocab]
    ids = tok.encode(C01, add_special_tokens=False).ids
    full = tok.decode(ids, skip_special_tokens=True)
    assert full == C01
    manager = make_manager(vocab, fast)
    deltas = stream(manager, StreamSpec("c01", [[i] for i in ids]))
    assert "".join(deltas) == full
    assert all("\ufffd" not in d for d in deltas)
    for d in deltas:
        d.encode("utf-8")
    # The vocabulary really splits characters across tokens: some steps must hold back.
    assert "" in deltas
    # Non-streamed (one step with every id) gives the same text.
    assert stream(manager, StreamSpec("c01-all", [ids])) == [full]


@pytest.mark.parametrize("vocab,fast", [("gemma3", True), ("gemma3", False), ("gemma3-strip", False)])
def test_c02_sentencepiece_spaces(vocab, fast, tokenizers, make_manager):
    tok = tokenizers[vocab]
    ids = tok.encode(C02, add_special_tokens=False).ids
    manager = make_manager(vocab, fast)
    assert manager.fast == fast
    assert "".join(stream(manager, StreamSpec("c02", [[i] for i in ids]))) == C02
    # The first generated token starts with ▁, after a prompt: its space must survive (a
    # Strip decoder drops it from decode(output ids) alone; the prompt context keeps it).
    tokens = tok.encode(C02, add_special_tokens=False).tokens
    for cut in (k for k, t in enumerate(tokens) if k and t.startswith("▁")):
        out = ids[cut:]
        expected = C02[len(tok.decode(ids[:cut])):]
        assert expected.startswith(" ")
        assert tok.decode(out, skip_special_tokens=True) == (expected[1:] if vocab == "gemma3-strip" else expected)
        spec = StreamSpec(f"c02-{cut}", [[i] for i in out], prompt_tail_ids=ids[max(0, cut - 5):cut])
        assert "".join(stream(manager, spec)) == expected
        tail = ids[max(0, cut - 5):cut]
        assert stream(manager, StreamSpec(f"c02-all-{cut}", [out], prompt_tail_ids=tail)) == [expected]


@pytest.mark.parametrize("vocab", VOCABS)
def test_c03_stop_prefix_never_leaks(vocab, tokenizers, make_manager):
    tok = tokenizers[vocab]
    manager = make_manager(vocab)
    stop = " 4 5 6 7"
    # The model continues " 4 5 6 7 8": the scheduler stops when " 4 5 6 7" is complete.
    ids = tok.encode(" 4 5 6 7", add_special_tokens=False).ids
    deltas = stream(manager, StreamSpec("c03", [[i] for i in ids], stop=[stop], finish=stop_finish(stop)))
    assert deltas == [""] * len(ids)
    # A near miss is released the moment it is ruled out, and a held tail at a
    # FINISH_LENGTH end is flushed.
    ids = tok.encode(" 4 5 6 8 9 10 11 12 13", add_special_tokens=False).ids
    deltas = stream(manager, StreamSpec("c03b", [[i] for i in ids], stop=[stop]))
    assert "".join(deltas) == " 4 5 6 8 9 10 11 12 13"
    sent = ""
    for k, d in enumerate(deltas):
        sent += d
        text = tok.decode(ids[:k + 1])
        held = text[len(sent):]
        assert len(held) <= len(stop) - 1
        # Whatever is held is a proper prefix of the stop; nothing else is held.
        assert held == "" or stop.startswith(held), (k, held)
    assert deltas[tok.encode(" 4 5 6 8", add_special_tokens=False).ids.__len__() - 1] == " 4 5 6 8"


C04_CASES = [
    # (text the model produces, stop, expected output)
    ("Rivers carve valleys.\n\nThey carry silt.\n\nDeltas form.", "\n\n", "Rivers carve valleys."),
    ("The great rivers of Europe", "rive", "The great "),  # ends inside " rivers"
    ("The great rivers of Europe flow", "of Europe fl", "The great rivers "),  # spans 3+ tokens
    ("The great rivers of Europe", "ers of", "The great riv"),  # shares " rivers" with text
]


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("text,stop,expected", C04_CASES)
def test_c04_stop_independent_of_token_boundaries(vocab, text, stop, expected, tokenizers, make_manager):
    tok = tokenizers[vocab]
    ids = tok.encode(text, add_special_tokens=False).ids
    # The scheduler stops at the first step whose decoded text holds the stop.
    end = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    assert tok.decode(ids[:end])[:tok.decode(ids[:end]).find(stop)] == expected
    manager = make_manager(vocab)
    spec = StreamSpec("c04", [[i] for i in ids[:end]], stop=[stop, "unrelated"], finish=stop_finish(stop))
    streamed = stream(manager, spec)
    assert "".join(streamed) == expected
    spec = StreamSpec("c04-all", [ids[:end]], stop=[stop], finish=stop_finish(stop))
    assert stream(manager, spec) == [expected]
    # no_stop_trim keeps the stop and the rest of its token.
    spec = StreamSpec("c04-keep", [[i] for i in ids[:end]], stop=[stop], finish=stop_finish(stop), no_stop_trim=True)
    assert "".join(stream(manager, spec)) == tok.decode(ids[:end])


def test_stop_token_id_trim(tokenizers, make_manager):
    tok = tokenizers["smollm2"]
    manager = make_manager("smollm2")
    ids = tok.encode("Hello there, quick fox", add_special_tokens=False).ids
    eos = tok.token_to_id("<|im_end|>")
    fin = common_pb2.FinishReason(type=common_pb2.FINISH_STOP, matched_token_id=eos)
    spec = StreamSpec("eos", [[i] for i in ids + [eos]], finish=fin, skip_special_tokens=False)
    assert "".join(stream(manager, spec)) == "Hello there, quick fox"
    spec = StreamSpec("eos-keep", [[i] for i in ids + [eos]], finish=fin, skip_special_tokens=False,
                      no_stop_trim=True)
    assert "".join(stream(manager, spec)) == "Hello there, quick fox<|im_end|>"
    # A stop token that is ordinary text: its text is dropped, the rest kept.
    fox = ids[-1]
    fin = common_pb2.FinishReason(type=common_pb2.FINISH_STOP, matched_token_id=fox)
    assert "".join(stream(manager, StreamSpec("fox", [[i] for i in ids], finish=fin))) == "Hello there, quick"


@pytest.mark.parametrize("vocab", VOCABS)
def test_stop_strings_property(vocab, tokenizers, ref_tables, make_manager):
    """1,000 generated strings x 2 feedings, 1-3 stop strings each, cut wherever they fall."""
    tok, table = tokenizers[vocab], ref_tables[vocab]
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    rng = random.Random(7)
    texts = generate(1_000, seed=8)
    encoded = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    cases, stops_of = [], {}
    for k, (text, ids) in enumerate(zip(texts, encoded, strict=True)):
        if not ids:
            continue
        stops = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.8:
                a = rng.randrange(len(text))
                stops.append(text[a:a + rng.randint(1, 8)])
            else:
                stops.append("QQ\x01")
        for one in (True, False):
            chunks = chunked(ids, rng, one)
            spec = StreamSpec(f"{k}-{one}", chunks, stop=stops)
            cases.append(Case(spec, ids, ""))
            stops_of[spec.rid] = stops
    # Simulate the scheduler: stop at the first step whose decoded text holds a stop.
    prefix_reqs = []
    for c in cases:
        fed = 0
        for ch in c.spec.chunks:
            fed += len(ch)
            prefix_reqs.append(c.ids[:fed])
    prefix_texts = iter(tok.decode_batch(prefix_reqs, skip_special_tokens=True))
    for c in cases:
        texts_at = [next(prefix_texts) for _ in c.spec.chunks]
        c.expected = texts_at[-1]
        for j, t in enumerate(texts_at):
            hits = [(t.find(s), s) for s in c.spec.stop if s in t]
            if hits:
                at, s = min(hits)
                c.spec.chunks = c.spec.chunks[:j + 1]
                c.ids = c.ids[:sum(map(len, c.spec.chunks))]
                c.spec.finish = stop_finish(s)
                c.expected = t[:at]
                break
        c.full = texts_at[len(c.spec.chunks) - 1]
    manager = make_manager(vocab)
    deltas: dict[str, list[str]] = {}
    for batch in build_steps([c.spec for c in cases]):
        collect(manager.handle_batch(batch), deltas)
    assert manager.num_decode_states == 0
    stopped = 0
    decided_reqs = [c.ids[:m] for c in cases for m in decided_positions(c, table, special)]
    decided = iter(tok.decode_batch(decided_reqs, skip_special_tokens=True))
    for c in cases:
        got = deltas[c.spec.rid]
        stopped += c.spec.finish.type == common_pb2.FINISH_STOP
        assert "".join(got) == c.expected, (c.spec.rid, c.spec.stop, got, c.expected)
        sent = 0
        longest = max(len(s) for s in c.spec.stop)
        for j, d in enumerate(got):
            assert c.expected.startswith(d, sent)
            sent += len(d)
            dec = next(decided)
            if j == len(got) - 1:
                continue
            stable = dec[:common_prefix_len(dec, c.full)]
            # Everything decided is sent except the longest tail that may still become a stop.
            need = len(stable)
            for p in range(max(0, len(stable) - longest + 1), len(stable)):
                if any(len(s) > len(stable) - p and s.startswith(stable[p:]) for s in c.spec.stop):
                    need = p
                    break
            assert sent >= min(need, len(c.expected)), (c.spec.rid, j, sent, need, stable)
    assert stopped > 1_000
