"""Readiness of a tokenizer instance: whether a token can get through one of its model replicas.

A connected link does not mean the ring works: a detokenizer stopped with SIGSTOP keeps
its TCP connections, and a subscription whose rows go elsewhere stays open and silent.
A replica (``services.tokenizer.replicas``) can move a token while all of these hold:

- both links are up (``<peer>_link_down`` otherwise);
- its scheduler and its detokenizer answered their latest gRPC health check SERVING, on
  the link's own channel, within ``check_timeout_s`` (``<peer>_health_check``). Checks run
  every ``check_interval_s`` and at once when a link comes up; a link whose first check
  has not answered is not ready yet. A stopped or wedged peer, a scheduler whose watchdog
  tripped and a peer that is shutting down fail here, within interval + timeout;
- it is not stalled: requests are dispatched to it and nothing has come back from its
  detokenizer for ``stall_s`` (``outputs_stalled``), the one failure a health check cannot
  see (the subscription no longer gets this instance's rows). The bound must exceed the
  longest step that yields no output (a long prefill on a CPU).

The instance is ready while at least one replica is: with several, a replica that cannot
move a token only leaves its share to the others (``ReplicaSet.pick`` prefers the ready
ones), so its gRPC health, and the gateway's ``/health``, fail only when none can.
Readiness only reports: it fails no request (a stopped peer that resumes finishes them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve.options.tokenizer import ReadinessOptions
from ringserve.v1 import tokenizer_pb2
from services.tokenizer.links import Link
from services.tokenizer.replicas import Replica

logger = logging.getLogger(__name__)

PEERS = ("scheduler", "detokenizer")
REASONS = (*(f"{peer}_link_down" for peer in PEERS), *(f"{peer}_health_check" for peer in PEERS), "outputs_stalled")


@dataclass(frozen=True, kw_only=True)
class ReadinessConfig(ReadinessOptions):
    """Bounds of the readiness checks, in seconds (see the module docstring); the fields are flags."""


# A peer's health check: None when it answered SERVING in time, else why not (a phrase
# that follows "the detokenizer at ADDRESS").
HealthCheck = Callable[[Link, float], Awaitable[str | None]]


async def grpc_health_check(link: Link, timeout_s: float) -> str | None:
    """``grpc.health.v1.Health/Check`` (whole server) on the link's channel."""
    channel = link.channel
    if channel is None:
        return "is not connected"
    try:
        resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"did not answer its health check within {timeout_s:g} s"
        return f"failed its health check ({exc.code().name})"
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        return f"reports {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}"
    return None


class ReadinessMonitor:
    """Checks every replica's peers and says which replicas can move a token.

    Args:
        replicas: the instance's replicas.
        outstanding: requests this instance has dispatched to a replica and not finished.
        config: the bounds.
        on_change: called with the instance's readiness whenever it changes.
        check: the peer health check (tests pass a fake).
        clock: monotonic seconds (the links' ``last_batch_at`` uses ``time.monotonic``).
    """

    def __init__(self, replicas: Sequence[Replica], outstanding: Callable[[Replica], int],
                 config: ReadinessConfig = ReadinessConfig(), on_change: Callable[[bool], object] = lambda ready: None,
                 check: HealthCheck = grpc_health_check, clock: Callable[[], float] = time.monotonic):
        self.replicas = tuple(replicas)
        self.outstanding = outstanding
        self.config = config
        self.on_change = on_change
        self.check = check
        self.clock = clock
        # Per link: (the link session it was checked in, the check's result); a result from an
        # earlier session does not count. Written on the event loop, read by metric scrapes too.
        self._results: dict[Link, tuple[int, str | None]] = {}
        self._waiting_since: dict[Replica, float] = {}  # when requests began to wait on a replica
        self._wake = {r: asyncio.Event() for r in self.replicas}
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = False
        self._could: set[Replica] = set()  # replicas that could move a token at the last publish
        self._stopping = False

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch(r), name=f"readiness-{r.name}") for r in self.replicas]

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def link_changed(self, link: Link) -> None:
        """A link went up or down: check its replica now (a new session needs a new check)."""
        for replica in self.replicas:
            if link in (replica.scheduler, replica.detokenizer):
                self._wake[replica].set()
        self.publish()

    def not_ready(self, replica: Replica) -> list[tokenizer_pb2.NotReady]:
        """Why ``replica`` cannot move a token now; empty when it can."""
        out = []
        for peer, link in zip(PEERS, (replica.scheduler, replica.detokenizer), strict=True):
            if not link.up:
                out.append(self._reason(replica, f"{peer}_link_down", f"the {peer} at {link.target} is not connected"))
                continue
            session, why = self._results.get(link, (-1, "has not answered a health check yet"))
            if session != link.sessions:
                why = "has not answered a health check yet"
            if why is not None:
                out.append(self._reason(replica, f"{peer}_health_check", f"the {peer} at {link.target} {why}"))
        since = self._waiting_since.get(replica)
        if since is not None:
            silent = self.clock() - max(since, replica.detokenizer.last_batch_at)
            if silent >= self.config.stall_s:
                out.append(self._reason(
                    replica, "outputs_stalled",
                    f"{self.outstanding(replica)} requests wait on this replica and nothing came back from the "
                    f"detokenizer at {replica.detokenizer.target} for {silent:.0f} s"))
        return out

    def can_move_tokens(self, replica: Replica) -> bool:
        return not self.not_ready(replica)

    @property
    def ready(self) -> bool:
        return any(self.can_move_tokens(r) for r in self.replicas)

    def readiness(self) -> tokenizer_pb2.Readiness:
        """The instance's readiness and every reason of every replica that is not ready."""
        reasons = [reason for r in self.replicas for reason in self.not_ready(r)]
        return tokenizer_pb2.Readiness(ready=self.ready, replicas=len(self.replicas), not_ready=reasons)

    def publish(self) -> None:
        """Log each replica that stopped (or started again) being able to move a token; tell
        ``on_change`` when the instance's readiness changed."""
        for replica in self.replicas:
            reasons = self.not_ready(replica)
            if replica in self._could and reasons:
                self._could.discard(replica)
                logger.warning("replica %s cannot move a token: %s", replica.name,
                               "; ".join(r.message for r in reasons))
            elif replica not in self._could and not reasons:
                self._could.add(replica)
                logger.info("replica %s can move tokens", replica.name)
        ready = self.ready
        if ready != self._ready:
            self._ready = ready
            self.on_change(ready)

    @staticmethod
    def _reason(replica: Replica, code: str, message: str) -> tokenizer_pb2.NotReady:
        return tokenizer_pb2.NotReady(replica=replica.name, reason=code, message=message)

    async def _check(self, link: Link) -> None:
        if not link.up:
            return
        session = link.sessions
        try:
            why = await self.check(link, self.config.check_timeout_s)
        except Exception as exc:
            why = f"failed its health check ({exc!r})"
        except asyncio.CancelledError:
            # grpc.aio cancels a call whose channel closes under it (the link went down and
            # closed it). Raised on, it ended this replica's watch loop: the replica then
            # stayed not ready after its peer came back (a scheduler killed mid-check).
            if self._stopping:
                raise
            why = "failed its health check (its channel closed under it)"
        self._results[link] = (session, why)

    async def _watch(self, replica: Replica) -> None:
        wake = self._wake[replica]
        while True:
            wake.clear()
            now = self.clock()
            if self.outstanding(replica):
                self._waiting_since.setdefault(replica, now)
            else:
                self._waiting_since.pop(replica, None)
            await asyncio.gather(self._check(replica.scheduler), self._check(replica.detokenizer))
            self.publish()
            try:
                await asyncio.wait_for(wake.wait(), self.config.check_interval_s)
            except TimeoutError:
                pass
