"""Prefill/decode pairs: when the replicas include prefill and decode schedulers
(``--disaggregation-mode``, reported in each LoadReport), a request goes to a pair.

``choose_pair`` picks the prefill scheduler by the ``Router`` (least outstanding work, then
prefix affinity: its prefix cache holds the prompt) and the decode scheduler by least
outstanding work. A ``Pair`` is the manager's ``Dispatcher`` for the request: the decode part
goes first (it reserves the request slot and KV rows), then the prefill part, which names the
decode scheduler's address (docs/disaggregation.md); an abort goes to both. Outputs come from
the decode side's detokenizer, or, when the handoff fails, an error row from the prefill side's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ringserve.v1 import disagg_pb2, scheduler_pb2
from services.tokenizer.errors import RequestError, unavailable
from services.tokenizer.router import Router

if TYPE_CHECKING:
    from services.tokenizer.replicas import Replica


class Pair:
    """A prefill replica and a decode replica serving requests together (a ``Dispatcher``)."""

    def __init__(self, prefill: Replica, decode: Replica):
        self.prefill, self.decode = prefill, decode
        self.members = (prefill, decode)

    @property
    def schedule_policy(self) -> str | None:
        return self.prefill.schedule_policy

    def send_req(self, req: scheduler_pb2.TokenizedGenerateReqInput) -> None:
        """Send the decode part, then the prefill part. Raises RequestError (UNAVAILABLE) when
        either stream is down (the decode part, if sent, is aborted)."""
        decode_part, prefill_part = scheduler_pb2.TokenizedGenerateReqInput(), scheduler_pb2.TokenizedGenerateReqInput()
        decode_part.CopyFrom(req)
        decode_part.disagg_role = disagg_pb2.DISAGG_ROLE_DECODE
        prefill_part.CopyFrom(req)
        prefill_part.disagg_role = disagg_pb2.DISAGG_ROLE_PREFILL
        prefill_part.disagg_bootstrap = self.decode.address.scheduler
        self.decode.send_req(decode_part)
        try:
            self.prefill.send_req(prefill_part)
        except RequestError:
            self.decode.send_abort(scheduler_pb2.AbortReq(rid=req.rid, reason="the prefill scheduler is not connected",
                                                          tokenizer_id=req.tokenizer_id))
            raise

    def send_abort(self, abort: scheduler_pb2.AbortReq) -> None:
        """Abort on both sides. Raises RequestError only when neither stream is up."""
        failed = []
        for member in self.members:
            try:
                member.send_abort(abort)
            except RequestError as exc:
                failed.append(exc)
        if len(failed) == len(self.members):
            raise failed[0]


def role(replica: Replica) -> str:
    """The replica's --disaggregation-mode as its scheduler last reported it ("null" while unknown)."""
    load = replica.scheduler.last_load
    return (load.disaggregation_mode or "null") if load is not None else "null"


class Pairs:
    """The pairs made so far, one object per (prefill, decode), so outstanding work adds up per pair."""

    def __init__(self) -> None:
        self._pairs: dict[tuple[str, str], Pair] = {}

    def choose(self, router: Router, input_ids: Sequence[int], eligible: Sequence[Replica],
               outstanding: Mapping[Any, int]) -> Pair | None:
        """A pair for the prompt, or None when ``eligible`` lacks a prefill or a decode replica."""
        prefill = [r for r in eligible if role(r) == "prefill"]
        decode = [r for r in eligible if role(r) == "decode"]
        if not prefill or not decode:
            return None

        def load(replica: Replica) -> int:
            return sum(n for d, n in outstanding.items() if d is replica or replica in getattr(d, "members", ()))

        name = router.choose(input_ids, {r.name: load(r) for r in prefill})
        router.record(input_ids, name)
        p = next(r for r in prefill if r.name == name)
        d = min(decode, key=lambda r: (load(r), r.name))
        return self._pairs.setdefault((p.name, d.name), Pair(p, d))


def no_pair(eligible: Sequence[Replica]) -> RequestError:
    """UNAVAILABLE for a cluster of prefill and decode replicas that lacks one side."""
    have = sorted({role(r) for r in eligible})
    return unavailable(f"no prefill/decode pair is up (the replicas up are {', '.join(have) or 'none'})")
