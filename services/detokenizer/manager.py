"""The detokenizer's core: scheduler step outputs (token ids) in, text per tokenizer out.

``DetokenizerManager.handle_batch`` takes one ``BatchTokenIDOutput`` (one scheduler step)
and returns one ``BatchStrOutput`` per owning tokenizer instance. It knows nothing of gRPC
(servicer.py adapts it), so tests and the benchmark drive it directly. Follows SGLang's
DetokenizerManager; the per-rid algorithm and its guarantees are in status.py.

Speed: in a decode step every row carries one id, and for most rows that id's text is a
whole character string with nothing pending, no stop string to watch and no finish. Those
rows need no per-row Python at all: their texts come from one ``map`` over a precomputed
id -> text list. Only the "irregular" rows (a partial character, an open byte run, stop
strings, special tokens kept, a finish, a new or unknown rid) go through ``DecodeStatus``.
"""

from __future__ import annotations

import logging
from codecs import utf_8_decode as _utf8_decode
from collections.abc import Sequence
from itertools import compress, count, repeat
from operator import attrgetter, is_, or_
from pathlib import Path
from typing import cast

from tokenizers import Tokenizer

from ringserve import columns
from ringserve.modelfacts import tokenizer_vocab_size
from ringserve.options.detokenizer import DetokenizerOptions
from ringserve.v1 import common_pb2, detokenizer_pb2
from services.detokenizer.offsets import offset_step
from services.detokenizer.output import group_outputs
from services.detokenizer.status import REPLACEMENT, DecodeStatus, fast_status, offset_status
from services.detokenizer.vocab import BYTE_LEVEL, ByteTable, build_byte_table, byte_fallback_ids, load_tokenizer

log = logging.getLogger(__name__)

DEFAULT_MAX_DECODE_STATES = DetokenizerOptions.max_decode_states  # the flag's default
FINISH_NONE = common_pb2.FINISH_NONE
FINISH_ABORT = common_pb2.FINISH_ABORT
_TYPE = attrgetter("type")
def _plain_texts(table: ByteTable) -> list[str | None]:
    """id -> its text when it is whole characters on its own (skip_special_tokens), else None."""
    out: list[str | None] = []
    for p in table.pieces_skip:
        if table.kind == BYTE_LEVEL:
            try:
                out.append(p.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(None)
        else:
            out.append(None if isinstance(p, int) else (p or ""))
    return out


class DetokenizerManager:
    """Decode states for every live rid, stepped one scheduler batch at a time.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` or a model directory holding tokenizer.json.
        max_decode_states: live states kept at most (``--max-decode-states``). A new rid
            beyond it is finished at once as FINISH_ABORT, never by evicting another.
        use_fast_path: False forces the offset algorithm even when the vocabulary verifies
            (tests and the benchmark compare both).
        table: a ByteTable already built for ``tokenizer`` (skips the ~0.5-2 s build).

    Raises:
        ValueError: max_decode_states < 1.
        FileNotFoundError: no tokenizer.json at the given path.

    Not thread-safe: one event loop owns it.
    """

    def __init__(self, tokenizer: Tokenizer | str | Path,
                 max_decode_states: int = DEFAULT_MAX_DECODE_STATES,
                 use_fast_path: bool = True, table: ByteTable | None = None) -> None:
        if max_decode_states < 1:
            raise ValueError(f"--max-decode-states must be >= 1, got {max_decode_states}")
        self.tokenizer = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
        self.max_decode_states = max_decode_states
        self.table = (table or build_byte_table(self.tokenizer)) if use_fast_path else None
        self._plain = _plain_texts(self.table) if self.table is not None else None
        self.vocab_size = tokenizer_vocab_size(self.tokenizer)
        self.special_ids = frozenset(
            i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special)
        self.byte_ids = byte_fallback_ids(self.tokenizer)
        self.states: dict[str, DecodeStatus] = {}
        # Fast path bookkeeping; a rid in neither set is decoded by table lookup alone.
        # _watched: stop strings or special tokens kept (DecodeStatus every step);
        # _pend: byte-level rids mid-character -> the bytes of that incomplete character;
        # _open: byte-fallback rids with an open run of <0xXX> tokens.
        self._watched: set[str] = set()
        self._pend: dict[str, bytes] = {}
        self._open: set[str] = set()
        # rids already answered with an error abort: their later rows are dropped until
        # the scheduler's own final row, so the owner gets one clear error, not one per step.
        self._refused: dict[str, None] = {}

    @property
    def num_decode_states(self) -> int:
        return len(self.states)

    def drop_all(self) -> int:
        """Forget every decode state (their scheduler is gone: no final row will come); return how many."""
        n = len(self.states)
        self.states.clear()
        self._watched.clear()
        self._pend.clear()
        self._open.clear()
        self._refused.clear()
        return n

    @property
    def fast(self) -> bool:
        return self.table is not None

    def handle_batch(self, batch: detokenizer_pb2.BatchTokenIDOutput) -> dict[str, detokenizer_pb2.BatchStrOutput]:
        """Decode one scheduler step.

        Args:
            batch: rows of (rid, tokenizer_id, new ids, optional RowInit, finish reason,
                counts, logprobs); ``output_ids`` holds every row's new ids back to back.

        Returns:
            tokenizer_id -> BatchStrOutput with that instance's rows in batch order: the new
            stable text, the ids, counts, finish reason and logprobs passed through. A row
            whose rid has no state (never initialized, or refused at capacity) comes back
            once as FINISH_ABORT with a message naming ``--max-decode-states``.
        """
        rids = list(batch.rids)
        n = len(rids)
        if n == 0:
            return {}
        errors: dict[int, common_pb2.FinishReason | None] = {}  # None: row dropped
        if batch.inits:
            self._create(batch, rids, errors)
        fins = batch.finish_reasons
        ftypes = list(map(_TYPE, fins)) if len(fins) == n else [FINISH_NONE] * n
        top_ns = None
        if batch.top_logprob_ids:
            top_ns = [st.top_logprobs_num if st else 0 for st in map(self.states.get, rids)]
        ids = list(batch.output_ids)
        texts = None
        if (self.table is not None and len(ids) == n and 0 not in batch.new_token_counts
                and self.states.keys() >= set(rids)):
            texts = self._decode_step(rids, ids, ftypes, fins, errors)
        if texts is None:
            texts = self._general_step(batch, rids, ids, ftypes, errors)
        return group_outputs(batch, rids, texts, ftypes, errors, top_ns)

    def decode_step(self, rids: list[str], ids: list[int], ftypes: list[int],
                    fins: Sequence[common_pb2.FinishReason]) -> list[str]:
        """The decode core of ``handle_batch`` without protobuf columns (benchmark, tests).

        Args:
            rids: one rid per row, each with a live state.
            ids: one new token id per row (int).
            ftypes: FinishReasonType per row; fins[i] is read only where ftypes[i] != 0.

        Returns:
            The new stable text per row, exactly as ``handle_batch`` would send it.

        Raises:
            ValueError: a rid has no state or an id is outside the vocabulary.
        """
        errors: dict = {}
        texts = None
        if self.table is not None and len(ids) == len(rids) and self.states.keys() >= set(rids):
            texts = self._decode_step(rids, ids, ftypes, fins, errors)
        if texts is None or errors:
            raise ValueError("decode_step needs one in-vocabulary id per row and a state per rid")
        return texts

    # ---- decoding --------------------------------------------------------------------

    def _decode_step(self, rids, ids, ftypes, fins, errors) -> list[str] | None:
        """One id per row, every rid known: table lookups; per-row Python only where needed."""
        if max(ids) >= self.vocab_size or min(ids) < 0:
            return None  # the general step reports the offending row
        full: dict[int, str] = {}  # rows that need DecodeStatus in full: finish, stops, specials kept
        if any(ftypes):
            full.update((i, "") for i, f in enumerate(ftypes) if f)
        if self._watched and not self._watched.isdisjoint(rids):
            full.update((i, "") for i, r in enumerate(rids) if r in self._watched)
        for i in full:
            full[i] = self._fast_row(i, rids[i], ids[i:i + 1], ftypes[i], fins, errors)
        assert self.table is not None  # decode_step runs only on the fast path
        if self.table.kind == BYTE_LEVEL:
            texts = self._byte_level_step(rids, ids, full)
        else:
            texts = self._byte_fallback_step(rids, ids, full)
        for i, text in full.items():
            texts[i] = text
        return cast("list[str]", texts)  # the rows left None by the table are the ones in full

    def _byte_level_step(self, rids, ids, full) -> list[str | None]:
        """Whole-character tokens by lookup; rows mid-character through the C UTF-8 decoder.

        ``_pend`` holds, per rid, the bytes of an incomplete character (at most 3).
        """
        plain, table = self._plain, self.table
        assert plain is not None and table is not None  # the fast path's tables
        texts = list(map(plain.__getitem__, ids))
        pend = self._pend
        # Rows mid-character: a partial token, or bytes pending; found with C-level maps.
        if pend and not pend.keys().isdisjoint(rids):
            partial = compress(count(), map(or_, map(is_, texts, repeat(None)), map(pend.__contains__, rids)))
        elif None in texts:
            partial = compress(count(), map(is_, texts, repeat(None)))
        else:
            return texts
        pieces = table.pieces_skip
        pop = pend.pop
        for i in partial:
            if i in full:
                continue
            rid = rids[i]
            data = pop(rid, b"") + pieces[ids[i]]
            # Same decode as DecodeStatus.fast_step, inlined: this loop is the hot path.
            texts[i], used = _utf8_decode(data, "replace", False)
            if used != len(data):
                pend[rid] = data[used:]
        return texts

    def _byte_fallback_step(self, rids, ids, full) -> list[str | None]:
        """Text tokens by lookup; rows with a byte token or an open byte run via DecodeStatus."""
        assert self._plain is not None  # the fast path's table
        texts = list(map(self._plain.__getitem__, ids))
        partial: list[int] = []
        if None in texts:
            partial = [i for i, t in enumerate(texts) if t is None]
        if self._open and not self._open.isdisjoint(rids):
            partial = list(dict.fromkeys(partial + [i for i, r in enumerate(rids) if r in self._open]))
        states, open_runs = self.states, self._open
        for i in partial:
            if i in full:
                continue
            rid = rids[i]
            st = states[rid]
            texts[i] = st.fast_step(ids[i:i + 1], False)
            if st.run:
                open_runs.add(rid)
            else:
                open_runs.discard(rid)
        return texts

    def _general_step(self, batch, rids, ids, ftypes, errors) -> list[str]:
        """Any mix of counts (prefill, speculative steps), unknown rids, or the offset path."""
        n = len(rids)
        fins = batch.finish_reasons
        texts = [""] * n
        slow: list[tuple[int, DecodeStatus, list[int], bool]] = []
        counts = batch.new_token_counts if len(batch.new_token_counts) == n else [0] * n  # missing: no new ids
        for i, row_ids in enumerate(columns.split(ids, counts)):
            if i in errors:
                continue
            if self.table is not None:
                texts[i] = self._fast_row(i, rids[i], row_ids, ftypes[i], fins, errors)
                continue
            st = self._row_state(i, rids[i], row_ids, ftypes[i], errors)
            if st is not None:
                slow.append((i, st, self._trim_stop_token(st, row_ids, ftypes[i], fins[i] if ftypes[i] else None),
                             ftypes[i] != FINISH_NONE))
        if slow:
            got = offset_step(self.tokenizer, [(st, r, f) for _, st, r, f in slow], self.special_ids,
                              self.byte_ids)
            for (i, st, _r, final), text in zip(slow, got, strict=True):
                texts[i] = self._finish(st, text, fins[i]) if final else st.release(text)
        return texts

    def _row_state(self, i: int, rid: str, row_ids: list[int], ftype: int, errors) -> DecodeStatus | None:
        st = self.states.get(rid)
        if st is None:
            errors[i] = self._missing(rid, ftype)
            return None
        if row_ids and (max(row_ids) >= self.vocab_size or min(row_ids) < 0):
            self.states.pop(rid, None)
            self._watched.discard(rid)
            self._open.discard(rid)
            self._pend.pop(rid, None)
            errors[i] = self._error(rid, ftype, f"rid {rid!r}: token id outside the vocabulary "
                                                f"(size {self.vocab_size})", "INTERNAL")
            return None
        return st

    @staticmethod
    def _trim_stop_token(st: DecodeStatus, row_ids: list[int], ftype: int, fin) -> list[int]:
        if (ftype != FINISH_NONE and not st.no_stop_trim and row_ids
                and fin.WhichOneof("matched") == "matched_token_id" and row_ids[-1] == fin.matched_token_id):
            # The stop token's own text is not part of the output (SGLang's
            # trim_matched_stop); its id still goes back to the tokenizer.
            return row_ids[:-1]
        return row_ids

    def _fast_row(self, i: int, rid: str, row_ids: list[int], ftype: int, fins, errors) -> str:
        st = self._row_state(i, rid, row_ids, ftype, errors)
        if st is None:
            return ""
        final = ftype != FINISH_NONE
        st.pending = self._pend.pop(rid, b"")
        text = st.fast_step(self._trim_stop_token(st, row_ids, ftype, fins[i] if final else None), final)
        if final:
            return self._finish(st, text, fins[i])
        if st.pending:
            self._pend[rid] = st.pending
            st.pending = b""
        if st.run:
            self._open.add(rid)
        else:
            self._open.discard(rid)
        return st.release(text)

    def _finish(self, st: DecodeStatus, text: str, fin: common_pb2.FinishReason) -> str:
        matched = fin.matched_str if fin.WhichOneof("matched") == "matched_str" else None
        del self.states[st.rid]
        self._watched.discard(st.rid)
        self._open.discard(st.rid)
        self._pend.pop(st.rid, None)
        return st.finish(text, matched)

    # ---- states ------------------------------------------------------------------------

    def _create(self, batch: detokenizer_pb2.BatchTokenIDOutput, rids: list[str], errors) -> None:
        """Create the states of this step's new rids (RowInit), refusing beyond capacity."""
        tids = batch.tokenizer_ids
        ftypes = batch.finish_reasons
        for init in batch.inits:
            i = init.row
            rid = rids[i]
            if rid in self.states:
                continue
            if len(self.states) >= self.max_decode_states:
                errors[i] = self._error(
                    rid, ftypes[i].type if len(ftypes) > i else FINISH_NONE,
                    f"detokenizer is at capacity: {len(self.states)} live decode states "
                    f"(--max-decode-states={self.max_decode_states}); rid {rid!r} was not started",
                    "RESOURCE_EXHAUSTED")
                continue
            fields = dict(
                rid=rid, tokenizer_id=tids[i], skip_special_tokens=init.skip_special_tokens,
                spaces_between_special_tokens=init.spaces_between_special_tokens,
                no_stop_trim=init.no_stop_trim, top_logprobs_num=init.top_logprobs_num,
                stop=list(init.stop))
            if self.table is not None:
                st = fast_status(self.table, **fields)
                if st.stops or not st.skip_special_tokens:
                    self._watched.add(rid)
            else:
                st = offset_status(self._context(init.prompt_tail_ids, init.skip_special_tokens), **fields)
            self.states[rid] = st
            self._refused.pop(rid, None)

    def _context(self, prompt_tail, skip: bool) -> list[int]:
        """Prompt tail ids usable as decode context: none that ends mid-character.

        A tail ending in an incomplete character would merge with the first output bytes
        and shift the offsets, and so would one ending in a ``<0xXX>`` run (a ByteFallback
        run decodes as one unit); dropping those ids costs only the context they carried.
        """
        ctx = [i for i in prompt_tail if 0 <= i < self.vocab_size]
        while ctx and (ctx[-1] in self.byte_ids
                       or self.tokenizer.decode(ctx, skip_special_tokens=skip).endswith(REPLACEMENT)):
            ctx.pop()
        return ctx

    def _error(self, rid: str, ftype: int, message: str, status: str) -> common_pb2.FinishReason | None:
        """The FINISH_ABORT that answers an unusable row, or None if it was already answered."""
        if rid in self._refused:
            if ftype != FINISH_NONE:
                del self._refused[rid]
            return None
        if ftype == FINISH_NONE:
            self._refused[rid] = None
            while len(self._refused) > self.max_decode_states:
                del self._refused[next(iter(self._refused))]
        log.error("rid %s: %s", rid, message)
        return common_pb2.FinishReason(type=FINISH_ABORT, message=message, status=status)

    def _missing(self, rid: str, ftype: int) -> common_pb2.FinishReason | None:
        return self._error(
            rid, ftype,
            f"detokenizer has no decode state for rid {rid!r}: its first row carried no RowInit, "
            f"or the state was refused or dropped (live states are capped by "
            f"--max-decode-states={self.max_decode_states})",
            "INTERNAL")
