"""Build token streams from strings and random ids, and check streamed deltas exactly."""

from __future__ import annotations

import codecs
import random
from dataclasses import dataclass

from tokenizers import Tokenizer

from services.detokenizer.manager import DetokenizerManager
from services.detokenizer.replay import StreamSpec, build_steps, collect
from services.detokenizer.vocab import BYTE_LEVEL, ByteTable


@dataclass
class Case:
    spec: StreamSpec
    ids: list[int]
    expected: str  # what the concatenated deltas must equal


def byte_ids(table: ByteTable) -> list[int]:
    """Ids that are a single raw byte (byte-level base tokens, or <0xXX> fallback tokens)."""
    if table.kind == BYTE_LEVEL:
        return [i for i, p in enumerate(table.pieces_keep) if len(p) == 1]
    return [i for i, p in enumerate(table.pieces_keep) if isinstance(p, int)]


def chunked(ids: list[int], rng: random.Random, one_by_one: bool) -> list[list[int]]:
    if one_by_one:
        return [[i] for i in ids]
    out, k = [], 0
    while k < len(ids):
        n = rng.randint(1, 8)
        out.append(ids[k:k + n])
        k += n
    return out


def make_cases(tok: Tokenizer, table: ByteTable, texts: list[str], n_random: int, seed: int,
               prefix: str = "") -> list[Case]:
    """Each text and each random id sequence, fed one id at a time and in random-size chunks."""
    rng = random.Random(seed)
    encoded = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    singles = byte_ids(table)
    special = sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    size = tok.get_vocab_size(with_added_tokens=True)
    seqs: list[tuple[list[int], bool]] = [(ids, True) for ids in encoded if ids]
    for _ in range(n_random):
        ids = []
        for _ in range(rng.randint(1, 40)):
            r = rng.random()
            ids.append(rng.choice(singles) if r < 0.4 else rng.choice(special) if r < 0.5 else rng.randrange(size))
        seqs.append((ids, rng.random() < 0.5))
    refs = {}
    for skip in (False, True):
        group = [k for k, (_, s) in enumerate(seqs) if s == skip]
        for k, text in zip(group, tok.decode_batch([seqs[k][0] for k in group], skip_special_tokens=skip), strict=True):
            refs[k] = text
    cases = []
    for k, (ids, skip) in enumerate(seqs):
        for one in (True, False):
            spec = StreamSpec(rid=f"{prefix}{k}-{'one' if one else 'chunk'}", chunks=chunked(ids, rng, one),
                              skip_special_tokens=skip, tokenizer_id=f"tok-{k % 3}")
            cases.append(Case(spec, ids, refs[k]))
    return cases


def run_cases(manager: DetokenizerManager, cases: list[Case], check_state=None) -> dict[str, list[str]]:
    """Feed every case through ``manager`` together; return rid -> deltas (one per step)."""
    deltas: dict[str, list[str]] = {}
    for batch in build_steps([c.spec for c in cases]):
        collect(manager.handle_batch(batch), deltas)
        if check_state is not None:
            check_state(manager)
    return deltas


def common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def decided_positions(case: Case, table: ByteTable, special: set[int]) -> list[int]:
    """Per step, the id count m whose text must already be sent after that step.

    Byte-level BPE: all but the last 3 visible tokens (an incomplete character is at most 3
    bytes). Byte fallback: everything before the open run of byte tokens, unless the run's
    bytes can no longer be valid UTF-8: then the whole run is decided (one U+FFFD per byte).
    """
    skip = case.spec.skip_special_tokens
    ids = case.ids
    pieces = table.pieces_keep
    out, fed = [], 0
    for chunk in case.spec.chunks:
        fed += len(chunk)
        m = fed
        if table.kind == BYTE_LEVEL:
            visible = 0
            while m > 0 and visible < 3:
                m -= 1
                if not (skip and ids[m] in special):
                    visible += 1
        else:
            while m > 0 and (isinstance(pieces[ids[m - 1]], int) or (skip and ids[m - 1] in special)):
                m -= 1
            run = bytes(pieces[i] for i in ids[m:fed] if isinstance(pieces[i], int))
            try:
                codecs.getincrementaldecoder("utf-8")().decode(run, final=False)
            except UnicodeDecodeError:
                m = fed
        out.append(m)
    return out


def check_cases(tok: Tokenizer, table: ByteTable, cases: list[Case], deltas: dict[str, list[str]]) -> int:
    """Assert every guarantee of status.py for every case; return the number of deltas checked."""
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    requests: dict[bool, list[list[int]]] = {False: [], True: []}
    where = []
    for c in cases:
        ms = decided_positions(c, table, special)[:-1]
        where.append((len(requests[c.spec.skip_special_tokens]), ms))
        requests[c.spec.skip_special_tokens].extend(c.ids[:m] for m in ms)
    prefixes = {skip: tok.decode_batch(reqs, skip_special_tokens=skip) for skip, reqs in requests.items()}
    checked = 0
    for c, (start, ms) in zip(cases, where, strict=True):
        got = deltas[c.spec.rid]
        assert len(got) == len(c.spec.chunks), c.spec.rid
        text = "".join(got)
        assert text == c.expected, (c.spec.rid, c.ids, text, c.expected)
        sent = 0
        for j, d in enumerate(got):
            d.encode("utf-8")  # no lone surrogate: valid UTF-8
            # Sent text is always a prefix of the final text: never repeated, reordered, or
            # holding a U+FFFD that the full decode does not have at that place.
            assert c.expected.startswith(d, sent), (c.spec.rid, j, d)
            sent += len(d)
            if j < len(ms):
                decided = prefixes[c.spec.skip_special_tokens][start + j]
                need = common_prefix_len(decided, c.expected)
                assert sent >= need, (c.spec.rid, j, c.ids, sent, need, decided)
            checked += 1
    return checked
