"""Property tests of the stream guarantees (services/detokenizer/status.py) on real vocabularies.

Per vocabulary: 2,000 generated multilingual strings plus 500 random id sequences (lone
byte tokens, special tokens, any id), each fed one id at a time and in random-size chunks,
all as concurrent rows of one manager (so each step is one batch, as from a scheduler).
"""

from __future__ import annotations

import pytest

from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.offsets import MAX_INCOMPLETE_TOKENS
from tests.helpers.detok_streams import check_cases, make_cases, run_cases
from tests.helpers.textgen import generate
from tests.helpers.vocabs import FAST_VOCABS, VOCABS

N_TEXTS = 2_000
N_RANDOM = 500


@pytest.mark.parametrize("vocab", FAST_VOCABS)
def test_fast_path_guarantees(vocab, tokenizers, tables):
    tok, table = tokenizers[vocab], tables[vocab]
    assert table is not None, f"{vocab}: byte table did not verify"
    cases = make_cases(tok, table, generate(N_TEXTS, seed=1), N_RANDOM, seed=2)
    assert len(cases) >= 2 * (N_TEXTS + N_RANDOM) - 10  # an empty encoding is skipped
    manager = DetokenizerManager(tok, table=table)
    assert manager.fast

    def bounded(m: DetokenizerManager) -> None:
        # Per-token state does not grow: at most 3 undecoded bytes per rid, no window.
        assert all(len(p) <= 3 for p in m._pend.values())
        for st in m.states.values():
            assert not st.decode_ids and not st.held and not st.pending

    deltas = run_cases(manager, cases, check_state=bounded if vocab == "smollm2" else None)
    assert check_cases(tok, table, cases, deltas) > 60_000
    assert manager.num_decode_states == 0


@pytest.mark.parametrize("vocab", VOCABS)
def test_offset_path_guarantees(vocab, tokenizers, ref_tables):
    """The general algorithm (for decoders without a verified table) meets the same guarantees."""
    tok, table = tokenizers[vocab], ref_tables[vocab]
    cases = make_cases(tok, table, generate(1_000, seed=3), 500, seed=4)
    manager = DetokenizerManager(tok, use_fast_path=False)
    assert not manager.fast
    longest_chunk = 8

    def bounded(m: DetokenizerManager) -> None:
        for st in m.states.values():
            # context (≤ 3 + a chunk) plus pending (< 4 visible tokens + a chunk); with byte
            # fallback, plus the byte runs still open (a run decodes all or nothing).
            window = [i for i in st.decode_ids if i not in m.byte_ids]
            assert len(window) <= 2 * (MAX_INCOMPLETE_TOKENS + longest_chunk) + 1, st.decode_ids

    deltas = run_cases(manager, cases, check_state=bounded)
    check_cases(tok, table, cases, deltas)
    assert manager.num_decode_states == 0
