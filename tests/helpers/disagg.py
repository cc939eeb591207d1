"""Two engines wired as a prefill/decode pair in one process, the KV moved by the ``grpc``
transfer engine's pieces without the network (``pack`` on the prefill side, ``receive`` on
the decode side)."""

from __future__ import annotations

from dataclasses import replace

from services.scheduler.disagg.handoff import Handoff
from services.scheduler.disagg.roles import Role
from services.scheduler.disagg.transfer import GrpcKvTransfer, KvLayout, pack, pieces
from services.scheduler.engine.engine import Engine
from services.scheduler.policy.req import ReqInput
from tests.helpers.engine_steps import Result, collect


class Pair:
    """A prefill engine and a decode engine wired by hand: each handoff is moved piece by piece."""

    def __init__(self, prefill: Engine, decode: Engine):
        self.prefill, self.decode = prefill, decode
        self.handoffs: list[Handoff] = []
        prefill.disagg.on_handoff = lambda handoff: self.handoffs.append(handoff)
        self.transfer = GrpcKvTransfer()
        self.moved = 0
        self.prefill_rows: dict[str, Result] = {}  # what the prefill side emitted (aborts only)
        self.peak_slots = 0  # the most request slots the decode side held at once (reserved or decoding)

    def add(self, spec: ReqInput) -> None:
        self.decode.add_request(replace(spec, disagg_role=Role.DECODE))
        self.prefill.add_request(replace(spec, disagg_role=Role.PREFILL, disagg_bootstrap="decode-0"))

    def move(self, handoff: Handoff) -> bool:
        rows = self.decode.disagg.rows_of(handoff.rid)
        if rows is None:
            return False  # not reserved yet: the prefill side waits (backpressure)
        pool = self.prefill.kv_pool
        for layer, start, end in pieces(KvLayout.of(pool), int(handoff.src_rows.numel())):
            self.moved += self.transfer.receive(self.decode.kv_pool, rows,
                                                pack(pool, handoff.rid, handoff.src_rows, layer, start, end))
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
            self.handoffs = [h for h in self.handoffs if not self.move(h)]
            if (out := self.decode.step()) is not None:
                collect(out, results)
            self.peak_slots = max(self.peak_slots, self.decode.load().req_slots_used)
        else:
            raise AssertionError(f"not done after 400 steps: {list(self.prefill.reqs)} {list(self.decode.reqs)}")
        return results
