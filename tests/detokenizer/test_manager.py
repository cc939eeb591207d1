"""DetokenizerManager behaviour around the decode algorithm: states, errors, routing, pass-through."""

from __future__ import annotations

import pytest

from ringserve.v1 import common_pb2, detokenizer_pb2
from services.detokenizer.replay import StreamSpec, build_steps


def row_batch(rows, inits=()):
    """rows: (rid, tokenizer_id, ids, finish_type); inits: RowInit kwargs per row index."""
    b = detokenizer_pb2.BatchTokenIDOutput()
    for rid, tid, ids, ftype in rows:
        b.rids.append(rid)
        b.tokenizer_ids.append(tid)
        b.new_token_counts.append(len(ids))
        b.output_ids.extend(ids)
        b.finish_reasons.add(type=ftype)
    for row, kw in inits:
        b.inits.add(row=row, skip_special_tokens=True, **kw)
    return b


def test_capacity_refuses_new_rid_with_clear_error(make_manager, tokenizers):
    tok = tokenizers["smollm2"]
    m = make_manager("smollm2", max_decode_states=2)
    hi = tok.encode("hi", add_special_tokens=False).ids
    none, length = common_pb2.FINISH_NONE, common_pb2.FINISH_LENGTH
    out = m.handle_batch(row_batch([("a", "t", hi, none), ("b", "t", hi, none), ("c", "t", hi, none)],
                                   [(0, {}), (1, {}), (2, {})]))
    o = out["t"]
    assert list(o.rids) == ["a", "b", "c"] and list(o.texts) == ["hi", "hi", ""]
    assert [f.type for f in o.finish_reasons] == [none, none, common_pb2.FINISH_ABORT]
    assert "--max-decode-states=2" in o.finish_reasons[2].message
    assert o.finish_reasons[2].status == "RESOURCE_EXHAUSTED"
    assert m.num_decode_states == 2
    # Later rows of the refused rid are dropped until its final row: one error, not one per step.
    out = m.handle_batch(row_batch([("a", "t", hi, length), ("c", "t", hi, none)]))
    assert list(out["t"].rids) == ["a"]
    assert m.handle_batch(row_batch([("c", "t", hi, common_pb2.FINISH_ABORT)])) == {}
    # A slot freed by a finish is usable again; the live states were never evicted.
    out = m.handle_batch(row_batch([("b", "t", hi, none), ("d", "t", hi, none)], [(1, {})]))
    assert list(out["t"].texts) == ["hi", "hi"]
    assert set(m.states) == {"b", "d"}


def test_missing_state_is_an_abort_naming_the_flag(make_manager, tokenizers):
    m = make_manager("qwen25")
    ids = tokenizers["qwen25"].encode("x", add_special_tokens=False).ids
    out = m.handle_batch(row_batch([("ghost", "t", ids, common_pb2.FINISH_NONE)]))
    fin = out["t"].finish_reasons[0]
    assert fin.type == common_pb2.FINISH_ABORT
    assert "no decode state for rid 'ghost'" in fin.message and "--max-decode-states" in fin.message
    assert out["t"].texts[0] == ""
    assert m.num_decode_states == 0


def test_out_of_vocabulary_id_aborts_only_that_row(make_manager):
    m = make_manager("smollm2")
    out = m.handle_batch(row_batch([("a", "t", [42], common_pb2.FINISH_NONE),
                                    ("b", "t", [10**7], common_pb2.FINISH_NONE)], [(0, {}), (1, {})]))
    assert [f.type for f in out["t"].finish_reasons] == [common_pb2.FINISH_NONE, common_pb2.FINISH_ABORT]
    assert "outside the vocabulary" in out["t"].finish_reasons[1].message
    assert set(m.states) == {"a"}


def test_rows_routed_per_tokenizer_with_logprobs_passed_through(make_manager, tokenizers):
    tok = tokenizers["gemma3"]
    m = make_manager("gemma3")
    a = tok.encode("Hello world", add_special_tokens=False).ids
    b = tok.encode("삼겹살", add_special_tokens=False).ids
    batch = row_batch([("a", "t1", a, common_pb2.FINISH_NONE), ("b", "t2", b, common_pb2.FINISH_LENGTH)],
                      [(0, {"top_logprobs_num": 2}), (1, {})])
    batch.prompt_tokens.extend([7, 9])
    batch.completion_tokens.extend([len(a), len(b)])
    batch.cached_tokens.extend([3, 0])
    batch.logprob_counts.extend([len(a), 0])
    batch.output_token_logprobs.extend([-0.5 * (k + 1) for k in range(len(a))])
    batch.top_logprob_ids.extend(range(2 * len(a)))
    batch.top_logprob_vals.extend([-1.0] * (2 * len(a)))
    out = m.handle_batch(batch)
    assert set(out) == {"t1", "t2"}
    o1, o2 = out["t1"], out["t2"]
    assert list(o1.rids) == ["a"] and list(o1.texts) == ["Hello world"]
    assert list(o1.output_ids) == a and list(o1.new_token_counts) == [len(a)]
    assert list(o1.output_token_logprobs) == [-0.5 * (k + 1) for k in range(len(a))]
    assert list(o1.top_logprobs_nums) == [2] and list(o1.top_logprob_ids) == list(range(2 * len(a)))
    assert (o1.prompt_tokens[0], o1.cached_tokens[0]) == (7, 3)
    assert list(o2.texts) == ["삼겹살"] and o2.finish_reasons[0].type == common_pb2.FINISH_LENGTH
    assert list(o2.output_ids) == b and list(o2.logprob_counts) == [0] and o2.prompt_tokens[0] == 9
    assert set(m.states) == {"a"}


def test_one_step_request_and_prefill_only_steps(make_manager, tokenizers):
    """A request that starts and finishes in one step, and steps with no new ids."""
    tok = tokenizers["smollm2"]
    m = make_manager("smollm2")
    ids = tok.encode("café 👍🏽", add_special_tokens=False).ids
    specs = [StreamSpec("one", [ids]), StreamSpec("gaps", [[], ids[:2], [], ids[2:], []])]
    texts: dict[str, str] = {}
    for batch in build_steps(specs):
        for o in m.handle_batch(batch).values():
            for rid, t in zip(o.rids, o.texts, strict=True):
                texts[rid] = texts.get(rid, "") + t
    assert texts == {"one": "café 👍🏽", "gaps": "café 👍🏽"}
    assert m.num_decode_states == 0


@pytest.mark.parametrize("vocab", ["smollm2", "gemma3", "gemma3-strip"])
def test_invalid_byte_is_committed_and_text_keeps_streaming(vocab, make_manager, tokenizers, ref_tables):
    """A lone continuation byte decodes to U+FFFD for good: it is sent, and so is what follows."""
    from tests.helpers.detok_streams import byte_ids

    tok, table = tokenizers[vocab], ref_tables[vocab]
    pieces = table.pieces_keep
    cont = next(i for i in byte_ids(table) if (pieces[i] if isinstance(pieces[i], int) else pieces[i][0]) == 0x80)
    # A Strip vocabulary's normalizer prepends the space itself.
    words = tok.encode(" and more text".removeprefix(" " if vocab == "gemma3-strip" else ""),
                       add_special_tokens=False).ids
    m = make_manager(vocab)
    spec = StreamSpec("bad", [[cont]] + [[i] for i in words])
    deltas: list[str] = []
    for batch in build_steps([spec]):
        deltas += [t for o in m.handle_batch(batch).values() for t in o.texts]
    assert deltas[0] == "\ufffd"  # committed at once, not held
    assert "".join(deltas) == tok.decode([cont] + words) == "\ufffd and more text"
    assert all(deltas[1:])  # every later token streams in its own step


class CountingTokenizer:
    """A tokenizers.Tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.decoded_ids = 0

    def decode_batch(self, seqs, **kw):
        self.decoded_ids += sum(map(len, seqs))
        return self.tok.decode_batch(seqs, **kw)

    def decode(self, ids, **kw):
        self.decoded_ids += len(ids)
        return self.tok.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.mark.parametrize("vocab,fast", [("gemma3", True), ("gemma3", False), ("gemma3-strip", False)])
@pytest.mark.parametrize("run", [500, 2_000])
def test_long_invalid_byte_run_streams_at_once_in_linear_work(vocab, fast, run, make_manager, tokenizers):
    """2,000 ``<0x80>`` tokens are 2,000 U+FFFD, one per step as each arrives (a
    lone continuation byte can never complete a character), then the text after them; the
    decoding work is linear in the stream (no window grows with the run)."""
    tok = tokenizers[vocab]
    cont = tok.token_to_id("<0x80>")
    e4, b8, ad = (tok.token_to_id(f"<0x{b:02X}>") for b in (0xE4, 0xB8, 0xAD))  # 中
    words = tok.encode("Hello there", add_special_tokens=False).ids
    ids = words + [cont] * run + words + [e4, b8, ad] + words
    m = make_manager(vocab, fast)
    assert m.fast == fast
    counting = CountingTokenizer(m.tokenizer)
    m.tokenizer = counting
    spec = StreamSpec("run", [[i] for i in ids], prompt_tail_ids=words)
    deltas: list[str] = []
    for batch in build_steps([spec]):
        deltas += [t for o in m.handle_batch(batch).values() for t in o.texts]
    n = len(words)
    hello = tok.decode(words + words)[len(tok.decode(words)):]  # " Hello there", with its space
    assert "".join(deltas[:n]) == hello
    assert deltas[n:n + run] == ["\ufffd"] * run  # each byte released in its own step
    k = 2 * n + run
    assert "".join(deltas[n + run:k]) == hello
    # A valid run is held until a text token closes it: ByteFallback decodes a run all or
    # nothing, so a later <0x80> would still turn this 中 into three U+FFFD.
    assert deltas[k:k + 3] == ["", "", ""] and deltas[k + 3].startswith("中")
    assert "".join(deltas) == hello + "\ufffd" * run + hello + "中" + hello
    assert counting.decoded_ids <= 12 * len(ids), counting.decoded_ids
    assert m.num_decode_states == 0
