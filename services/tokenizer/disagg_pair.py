"""Prefill/decode pairs: when the replicas include prefill and decode schedulers
(``--disaggregation-mode``, reported in each LoadReport), a request goes to a pair.

``choose_pair`` picks the prefill scheduler by the ``Router`` (least outstanding work, then
prefix affinity: its prefix cache holds the prompt) and the decode scheduler by least
outstanding work. A ``Pair`` is the manager's ``Dispatcher`` for the request: the decode part
goes first (it reserves the request slot and KV rows), then the prefill part, which names the
decode scheduler's address (docs/disaggregation.md); an embedding goes to the prefill scheduler
alone; an abort goes to both. Outputs come from
the decode side's detokenizer, or, when the handoff fails, an error row from the prefill side's.

When a pair's prefill scheduler goes away before any output of a request reached its call,
``redispatch`` sends the request to another pair (at most ``PREFILL_RETRIES`` times) and
aborts it on the old one, whose decode side frees its reservation.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ringserve.v1 import disagg_pb2, scheduler_pb2
from services.tokenizer.errors import RequestError, unavailable
from services.tokenizer.router import Router

if TYPE_CHECKING:
    from services.tokenizer.dispatch import Balancer
    from services.tokenizer.replicas import Replica
    from services.tokenizer.state import ReqState

logger = logging.getLogger(__name__)

# Re-dispatches of one request after its prefill scheduler went away: one, since a second
# prefill scheduler lost under the same request points at a wider outage than a retry mends.
PREFILL_RETRIES = 1


class Pair:
    """A prefill replica and a decode replica serving requests together (a ``Dispatcher``)."""

    def __init__(self, prefill: Replica, decode: Replica):
        self.prefill, self.decode = prefill, decode
        self.members = (prefill, decode)

    @property
    def schedule_policy(self) -> str | None:
        return self.prefill.schedule_policy

    def send_req(self, req: scheduler_pb2.TokenizedGenerateReqInput) -> None:
        """Send the decode part, then the prefill part; an embedding (prefill only, nothing to
        hand over) goes whole to the prefill scheduler and reserves nothing on the decode side.
        Raises RequestError (UNAVAILABLE) when either stream is down (the decode part, if sent,
        is aborted)."""
        if req.embed:
            self.prefill.send_req(req)
            return
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


def redispatch(st: ReqState, lost: Any, balancer: Balancer | None, outstanding: Mapping[Any, int],
               tokenizer_id: str) -> tuple[Pair, str] | None:
    """Send ``st``'s request to another pair when ``lost`` (a replica whose link went down) was
    its pair's prefill side; return that pair and the rid the request went under there.

    The old pair gets an abort for the old rid (its decode side frees the reservation: slot
    and KV rows); the new attempt has a new rid (``attempt_rid``), so that the old decode
    side's final (abort) row reaches no live state. The new pair may share the old decode
    replica. None (the caller fails the request as before) when the pair's prefill side is
    not ``lost``, a row already reached the call (the client saw output), the request is
    aborted or finished, its ``PREFILL_RETRIES`` are spent, or no other pair is up or takes it
    (the balancer picks among replicas up, and ``lost`` is down by now).
    """
    pair = st.replica
    if (not isinstance(pair, Pair) or pair.prefill is not lost or balancer is None or st.request is None
            or st.answered or st.abort_sent or st.finished or st.retries >= PREFILL_RETRIES):
        return None
    try:
        other = balancer.pick(st.request.input_ids, outstanding)
    except RequestError:
        return None
    if not isinstance(other, Pair) or other.prefill is lost:
        return None
    req = scheduler_pb2.TokenizedGenerateReqInput()
    req.CopyFrom(st.request)
    req.rid = attempt_rid(st.request.rid, st.retries + 1)
    try:
        pair.send_abort(scheduler_pb2.AbortReq(rid=st.rid, reason="its prefill scheduler went away",
                                               tokenizer_id=tokenizer_id))
    except RequestError:
        pass  # neither side is up: each dropped the request with its stream
    try:
        other.send_req(req)
    except RequestError:
        return None  # it fails as it would have (the old pair already has its abort)
    logger.warning("request %s: its prefill scheduler %s went away; sent to %s + %s as %s", st.rid, lost.name,
                   other.prefill.name, other.decode.name, req.rid)
    return other, req.rid


def attempt_rid(rid: str, attempt: int) -> str:
    """The rid of a request's ``attempt``-th re-dispatch (``rid`` the call's sub-rid)."""
    return f"{rid}/retry{attempt}"
