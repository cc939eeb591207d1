"""Every end of a disaggregated request between two in-process engines (``tests.helpers.disagg``)
frees the request slot and the KV rows on both sides: an abort before the reservation, between
the prefill side's chunks, while the KV moves, after the commit; a pool too full to reserve
(backpressure, then it goes on); a handoff that failed on the prefill side; a commit short of
the prompt's rows; a reservation whose commit never comes."""

from __future__ import annotations

import pytest

from services.scheduler.disagg.handoff import ShortCommit
from services.scheduler.disagg.transfer import KvLayout, pack
from services.scheduler.engine.engine import Engine
from services.scheduler.policy.req import FinishType
from tests.helpers.disagg import Pair
from tests.helpers.engine_steps import Result, collect


@pytest.fixture
def pair(make_engine) -> Pair:
    return Pair(make_engine(max_total_tokens=512), make_engine(max_total_tokens=96))


def _idle(engine: Engine) -> tuple[int, int, int, int, int]:
    load = engine.load()
    return (load.req_slots_used, load.kv_used_tokens, load.num_transfer_reqs, len(engine.reqs),
            engine.disagg.num_held)


def _drain(engine: Engine) -> dict[str, Result]:
    results: dict[str, Result] = {}
    while engine.has_work and not engine.only_compiling:
        if (out := engine.step()) is not None:
            collect(out, results)
    if (out := engine.step()) is not None:
        collect(out, results)
    return results


def test_abort_before_the_reservation_frees_both_sides(pair, greedy_req, chat_ids):
    pair.add(greedy_req("hog", chat_ids("Say something long. " * 20), max_new_tokens=4))  # 90 of 96 rows
    pair.add(greedy_req("queued", chat_ids("Hi."), max_new_tokens=4))
    assert pair.decode.disagg.rows_of("hog") is not None and list(pair.decode.disagg.waiting)[0].rid == "queued"
    for engine in (pair.decode, pair.prefill):
        assert engine.abort("queued") == 1 and engine.abort("hog") == 1
    assert _drain(pair.decode)["queued"].finish.type == FinishType.ABORT
    _drain(pair.prefill)
    assert pair.handoffs == [] and _idle(pair.prefill) == _idle(pair.decode) == (0, 0, 0, 0, 0)


def test_abort_while_the_kv_moves_writes_nothing_and_frees_both_sides(pair, greedy_req, chat_ids):
    pair.add(greedy_req("r", chat_ids("Name a river."), max_new_tokens=4))
    while not pair.handoffs:
        pair.prefill.step()
    handoff = pair.handoffs.pop()
    rows = pair.decode.disagg.rows_of("r")
    assert rows is not None and pair.prefill.disagg.sending.keys() == {"r"}
    pool = pair.prefill.kv_pool
    pair.transfer.receive(pair.decode.kv_pool, rows, pack(pool, "r", handoff.src_rows, 0, 0, 4))  # one piece in
    assert pair.decode.abort("r") == 1 and pair.prefill.abort("r") == 1
    assert pair.decode.disagg.rows_of("r") is None  # the next piece finds no rows: PushKv answers NOT_FOUND
    assert not pair.decode.disagg.commit(handoff.commit)
    pair.prefill.disagg.handed("r")  # the sender's end, after the abort: nothing left to do
    assert _drain(pair.decode)["r"].finish.type == FinishType.ABORT
    assert _drain(pair.prefill)["r"].finish.type == FinishType.ABORT
    assert _idle(pair.prefill) == _idle(pair.decode) == (0, 0, 0, 0, 0)
    assert pair.prefill.load().kv_cached_tokens == len(handoff.src_rows)  # its prompt stays cached there
    assert KvLayout.of(pool).row_bytes * 2 * len(pool.k_buffer) == pool.bytes_per_token()


@pytest.mark.parametrize("end", ["abort", "failed"])
def test_abort_or_failure_between_chunks_stops_the_sender_and_frees_both_sides(make_engine, greedy_req, chat_ids, end):
    pair = Pair(make_engine(max_total_tokens=512, chunked_prefill_size=4), make_engine(max_total_tokens=96))
    prompt = chat_ids("Name a river.")
    pair.add(greedy_req("r", prompt, max_new_tokens=4))
    pair.prefill.step()  # the first chunk: its handoff opened before it, its rows handed on after it
    pair.move_ranges()
    assert (pair.ranges, pair.pending) == ({"r": [(0, 4)]}, {"r": []})
    pair.prefill.step()
    assert [(first, len(rows)) for first, rows in pair.pending["r"]] == [(4, 4)] and len(prompt) == 13
    if end == "abort":
        assert pair.prefill.abort("r") == 1
    else:  # the sender failed before the first token (the decode scheduler gone): the request ends now
        pair.prefill.disagg.handed("r", "the handoff to the decode scheduler at decode-0 failed: UNAVAILABLE: gone")
    assert pair.decode.abort("r") == 1
    assert pair.pending == {}  # the sender was told to stop (or forgets it)
    row = _drain(pair.prefill)["r"]
    assert (row.finish.type, row.finish.status, row.output_ids) == (
        FinishType.ABORT, "CANCELLED" if end == "abort" else "UNAVAILABLE", [])
    _drain(pair.decode)
    assert pair.handoffs == [] and _idle(pair.prefill) == _idle(pair.decode) == (0, 0, 0, 0, 0)


def test_a_commit_short_of_the_prompt_is_refused_until_every_row_is_written(pair, greedy_req, chat_ids):
    pair.add(greedy_req("r", chat_ids("Name a river."), max_new_tokens=4))
    while not pair.handoffs:
        pair.prefill.step()
    handoff = pair.handoffs.pop()
    n, layers = len(handoff.src_rows), len(pair.prefill.kv_pool.k_buffer)
    pair.decode.disagg.receive(pair.transfer, pack(pair.prefill.kv_pool, "r", handoff.src_rows, 0, 0, n))  # layer 0
    with pytest.raises(ShortCommit, match=f"^the commit of 'r' came with {(layers - 1) * n} of its {layers * n} KV "
                                          r"rows \(layers x prompt positions\) not written$"):
        pair.decode.disagg.commit(handoff.commit)
    with pytest.raises(ValueError, match=f"^KV positions 1..{n} are outside the {n} reserved rows$"):
        pair.decode.disagg.wrote("r", 1, n)
    assert pair.decode.disagg.wrote("r", 0, n)  # a one-sided engine's report: every layer of the range
    assert pair.decode.disagg.commit(handoff.commit) and not pair.decode.disagg.wrote("r", 0, n)
    pair.prefill.disagg.handed("r")
    assert len(_drain(pair.decode)["r"].output_ids) == 4
    assert _idle(pair.prefill) == _idle(pair.decode) == (0, 0, 0, 0, 0)


@pytest.mark.parametrize("end", ["lease", "commit", "deadline"])
def test_an_aborted_reservation_that_the_peer_writes_into_holds_its_rows_until_the_sender_is_done(
        pair, greedy_req, chat_ids, end):
    pair.decode.disagg.one_sided = True  # as with the mooncake engine: the prefill side writes the rows itself
    pair.add(greedy_req("r", chat_ids("Name a river."), max_new_tokens=4))
    while not pair.handoffs:
        pair.prefill.step()
    handoff = pair.handoffs.pop()
    prompt_len = len(handoff.src_rows)
    assert pair.decode.disagg.lend("r") is not None  # the Reserve reply: the peer may write from now on
    assert pair.decode.abort("r") == 1 and pair.prefill.abort("r") == 1
    _drain(pair.decode)
    load = pair.decode.load()
    assert (load.req_slots_used, load.kv_used_tokens) == (0, prompt_len)  # a write may still be landing
    if end == "lease":
        pair.decode.disagg.writer_done("r")  # the sender's lease stream ended (done, or the sender gone)
    elif end == "commit":
        assert not pair.decode.disagg.commit(handoff.commit)  # the sender is done: the rows go back
    else:
        pair.decode.disagg.timeout_s = 0.0  # past the handoff's deadline no write lands: the next step frees them
        pair.decode.step()
    pair.prefill.disagg.handed("r")
    _drain(pair.prefill)
    assert _idle(pair.prefill) == _idle(pair.decode) == (0, 0, 0, 0, 0) and pair.decode.disagg.landing == {}


def test_abort_after_the_commit_frees_both_sides(pair, greedy_req, chat_ids):
    pair.add(greedy_req("r", chat_ids("Name a river."), max_new_tokens=30, ignore_eos=True))
    for _ in range(20):
        pair.prefill.step()
        pair.handoffs = [h for h in pair.handoffs if not pair.move(h)]
        if pair.decode.policy.running:
            break
    assert [r.rid for r in pair.decode.policy.running] == ["r"], (pair.handoffs, pair.decode.disagg.reserved)
    assert _idle(pair.prefill) == (0, 0, 0, 0, 0)  # its part is done: its rows are cache
    pair.decode.step()
    assert pair.decode.abort("r") == 1 and pair.prefill.abort("r") == 0
    assert _drain(pair.decode)["r"].finish.type == FinishType.ABORT
    assert _idle(pair.decode) == (0, 0, 0, 0, 0)


def test_a_full_decode_pool_holds_the_handoff_back_until_rows_free(pair, greedy_req, chat_ids):
    long, short = chat_ids("Say something long. " * 20), chat_ids("Hi.")
    pair.add(greedy_req("hog", long, max_new_tokens=4, ignore_eos=True))
    pair.add(greedy_req("later", short, max_new_tokens=4, ignore_eos=True))
    results = pair.run()  # "later" is prefilled at once, reserved and moved only after "hog" ends
    assert {rid: len(r.output_ids) for rid, r in results.items()} == {"hog": 4, "later": 4}
    assert pair.decode.kv_pool.size < len(long) + len(short) + 8  # they never fit together
    assert _idle(pair.prefill) == _idle(pair.decode) == (0, 0, 0, 0, 0)


def test_a_failed_handoff_ends_the_request_on_the_prefill_side(pair, greedy_req, chat_ids):
    pair.add(greedy_req("r", chat_ids("Name a river."), max_new_tokens=4))
    while not pair.handoffs:
        pair.prefill.step()
    pair.prefill.disagg.handed("r", "the handoff to the decode scheduler at decode-0 failed: UNAVAILABLE: gone")
    row = _drain(pair.prefill)["r"]
    assert (row.finish.type, row.finish.status, row.output_ids) == (FinishType.ABORT, "UNAVAILABLE", [])
    assert row.finish.message.endswith("decode-0 failed: UNAVAILABLE: gone") and row.init_rows == [0]
    assert _idle(pair.prefill) == (0, 0, 0, 0, 0)


def test_a_reservation_without_commit_ends_with_deadline_exceeded(pair, greedy_req, chat_ids):
    pair.decode.disagg.timeout_s = 0.0
    pair.add(greedy_req("r", chat_ids("Name a river."), max_new_tokens=4))
    row = _drain(pair.decode)["r"]
    assert (row.finish.type, row.finish.status) == (FinishType.ABORT, "DEADLINE_EXCEEDED")
    assert row.finish.message == "the KV transfer did not finish within 0 s (--disaggregation-transfer-timeout)"
    assert _idle(pair.decode) == (0, 0, 0, 0, 0)
