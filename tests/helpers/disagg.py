"""Two engines wired as a prefill/decode pair in one process, the KV moved by the ``grpc``
transfer engine's pieces without the network (``pack`` on the prefill side, ``receive`` on
the decode side), range by range as the prefill engine hands them on: each chunk's rows once
the chunk is computed, the last with the handoff."""

from __future__ import annotations

from dataclasses import replace

import torch

from services.scheduler.disagg.handoff import Handoff
from services.scheduler.disagg.roles import Role
from services.scheduler.disagg.transfer import GrpcKvTransfer, KvLayout, Range, pack, pieces
from services.scheduler.engine.engine import Engine
from services.scheduler.policy.req import ReqInput
from tests.helpers.engine_steps import Result, collect


class Pair:
    """A prefill engine and a decode engine wired by hand: each handoff is moved piece by piece."""

    def __init__(self, prefill: Engine, decode: Engine):
        self.prefill, self.decode = prefill, decode
        self.handoffs: list[Handoff] = []
        self.pending: dict[str, list[Range]] = {}  # ranges handed on, not moved yet (the rid's handoff is open)
        self.ranges: dict[str, list[tuple[int, int]]] = {}  # the positions moved, range by range
        self.early: dict[str, int] = {}  # ranges moved before the rid's first token was sampled
        prefill.disagg.on_open = lambda rid, bootstrap, num_tokens: self.pending.setdefault(rid, [])
        prefill.disagg.on_range = lambda rid, first, rows: self.pending[rid].append((first, rows))
        prefill.disagg.on_handoff = lambda handoff: self.handoffs.append(handoff)
        prefill.disagg.on_cancel = lambda rid: self.pending.pop(rid, None)
        self.transfer = GrpcKvTransfer()
        self.moved = 0
        self.prefill_rows: dict[str, Result] = {}  # what the prefill side emitted (aborts only)
        self.peak_slots = 0  # the most request slots the decode side held at once (reserved or decoding)

    def add(self, spec: ReqInput) -> None:
        self.decode.add_request(replace(spec, disagg_role=Role.DECODE))
        self.prefill.add_request(replace(spec, disagg_role=Role.PREFILL, disagg_bootstrap="decode-0"))

    def move_range(self, rid: str, first: int, src_rows: torch.Tensor) -> None:
        """Move one range's pieces into the decode side's reservation of ``rid``."""
        pool = self.prefill.kv_pool
        for layer, start, end in pieces(KvLayout.of(pool), int(src_rows.numel())):
            self.moved += self.decode.disagg.receive(self.transfer, pack(pool, rid, src_rows, layer, start, end, first))
        self.ranges.setdefault(rid, []).append((first, first + int(src_rows.numel())))

    def move_ranges(self) -> None:
        """Move the ranges of every reserved request (the others wait: backpressure)."""
        for rid, ranges in self.pending.items():
            if self.decode.disagg.rows_of(rid) is not None:
                for first, src_rows in ranges:
                    self.move_range(rid, first, src_rows)
                    self.early[rid] = self.early.get(rid, 0) + 1
                ranges.clear()

    def move(self, handoff: Handoff) -> bool:
        if self.decode.disagg.rows_of(handoff.rid) is None:
            return False  # not reserved yet: the prefill side waits (backpressure)
        for first, src_rows in self.pending.pop(handoff.rid, []):
            self.move_range(handoff.rid, first, src_rows)
        self.move_range(handoff.rid, handoff.start, handoff.src_rows[handoff.start :])
        assert self.decode.disagg.commit(handoff.commit)
        self.prefill.disagg.handed(handoff.rid)
        return True

    def run(self) -> dict[str, Result]:
        results: dict[str, Result] = {}
        for _ in range(400):  # every request here ends in far fewer steps
            if not (self.prefill.has_work or self.decode.has_work or self.handoffs):
                break
            if (out := self.prefill.step()) is not None:
                collect(out, self.prefill_rows)
            self.move_ranges()
            self.handoffs = [h for h in self.handoffs if not self.move(h)]
            if (out := self.decode.step()) is not None:
                collect(out, results)
            self.peak_slots = max(self.peak_slots, self.decode.load().req_slots_used)
        else:
            raise AssertionError(f"not done after 400 steps: {list(self.prefill.reqs)} {list(self.decode.reqs)}")
        return results
