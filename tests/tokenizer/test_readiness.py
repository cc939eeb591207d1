"""Readiness (services.tokenizer.readiness) on real Replica objects without a network: the
links' state is set by hand, the peers' health checks are scripted, so each rule is checked
on its own: not ready until checked, a failed check, a lost link, stalled outputs, several
replicas, the router's preference, the metric families. ``grpc_health_check`` itself runs
against real gRPC servers: one that answers, one NOT_SERVING, one that never answers."""

from __future__ import annotations

import asyncio
import socket

from prometheus_client import CollectorRegistry, generate_latest

from ringserve.grpcutil import insecure_channel, start_server
from ringserve.v1 import tokenizer_pb2
from services.tokenizer.links import Link
from services.tokenizer.metrics import ReadinessCollector
from services.tokenizer.readiness import ReadinessConfig, ReadinessMonitor, grpc_health_check
from services.tokenizer.replicas import Replica, ReplicaAddress, ReplicaSet

CONFIG = ReadinessConfig(check_interval_s=0.05, check_timeout_s=0.1, stall_s=1.0)


def replica(i: int) -> Replica:
    return Replica(ReplicaAddress(f"10.0.0.{i}:30020", f"10.0.0.{i}:30030"), "tok-t", lambda batch: None,
                   lambda link, up: None)


def connect(link: Link) -> None:
    link.up = True
    link.sessions += 1


class Peers:
    """Scripted health checks: ``answers[target]`` is returned (None = SERVING); ``calls`` counts them."""

    def __init__(self) -> None:
        self.answers: dict[str, str | None] = {}
        self.calls = 0

    async def check(self, link: Link, timeout_s: float) -> str | None:
        self.calls += 1
        assert timeout_s == CONFIG.check_timeout_s
        return self.answers.get(link.target)


async def settle(monitor: ReadinessMonitor, peers: Peers) -> None:
    """Wait until every link of every replica has been checked twice more (the watch loops ran)."""
    start = peers.calls
    await until(lambda: peers.calls >= start + 4 * len(monitor.replicas))


async def until(predicate, timeout_s: float = 5.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


def reasons(monitor: ReadinessMonitor, r: Replica) -> list[tuple[str, str]]:
    return [(x.reason, x.message) for x in monitor.not_ready(r)]


async def test_one_replica_link_check_and_stall_rules():
    r = replica(1)
    peers = Peers()
    waiting = {"n": 0}
    changes: list[bool] = []
    monitor = ReadinessMonitor([r], lambda _: waiting["n"], CONFIG, changes.append, peers.check)
    monitor.start()
    try:
        assert reasons(monitor, r) == [
            ("scheduler_link_down", "the scheduler at 10.0.0.1:30020 is not connected"),
            ("detokenizer_link_down", "the detokenizer at 10.0.0.1:30030 is not connected")]
        connect(r.scheduler)
        connect(r.detokenizer)
        # Up but not yet checked in this session: not ready.
        assert reasons(monitor, r) == [
            ("scheduler_health_check", "the scheduler at 10.0.0.1:30020 has not answered a health check yet"),
            ("detokenizer_health_check", "the detokenizer at 10.0.0.1:30030 has not answered a health check yet")]
        monitor.link_changed(r.detokenizer)
        await until(lambda: monitor.ready)
        assert reasons(monitor, r) == [] and changes == [True]

        peers.answers["10.0.0.1:30030"] = "did not answer its health check within 0.1 s"
        await until(lambda: not monitor.ready)
        assert changes == [True, False]
        assert reasons(monitor, r) == [
            ("detokenizer_health_check",
             "the detokenizer at 10.0.0.1:30030 did not answer its health check within 0.1 s")]
        peers.answers.clear()
        await until(lambda: monitor.ready)
        assert changes == [True, False, True]

        # A new session of a link needs a new check: a result from the old one does not count.
        r.scheduler.sessions += 1
        assert [x for x, _ in reasons(monitor, r)] == ["scheduler_health_check"]
        await until(lambda: monitor.ready)

        # Requests wait and nothing comes back for stall_s: outputs_stalled (checks still pass).
        waiting["n"] = 3
        await settle(monitor, peers)
        assert monitor.ready  # less than stall_s so far
        await until(lambda: not monitor.ready)
        [(code, message)] = reasons(monitor, r)
        assert code == "outputs_stalled"
        assert message.startswith("3 requests wait on this replica and nothing came back from the detokenizer "
                                  "at 10.0.0.1:30030 for ") and message.endswith(" s")
        await settle(monitor, peers)
        assert changes == [True, False, True, False]  # published by the watch loop (gRPC health follows it)
        r.detokenizer.last_batch_at = monitor.clock()  # a batch arrived
        assert reasons(monitor, r) == []
        await settle(monitor, peers)
        assert changes == [True, False, True, False, True]
        waiting["n"] = 0
        await settle(monitor, peers)
        await asyncio.sleep(CONFIG.stall_s)
        assert reasons(monitor, r) == []  # idle: nothing is expected back
    finally:
        await monitor.stop()


async def test_a_check_cancelled_by_its_closed_channel_leaves_the_watch_running():
    """A link that goes down closes its channel, and grpc.aio cancels a health check in flight
    on it (asyncio.CancelledError). The watch goes on: when the peer is back the replica is
    ready again (it stayed not ready for good after a scheduler was killed mid-check)."""
    r = replica(1)
    peers = Peers()
    cancelled = {"n": 0}

    async def check(link: Link, timeout_s: float) -> str | None:
        if link is r.scheduler and not cancelled["n"]:
            cancelled["n"] += 1
            raise asyncio.CancelledError
        return await peers.check(link, timeout_s)

    monitor = ReadinessMonitor([r], lambda _: 0, CONFIG, check=check)
    monitor.start()
    try:
        connect(r.scheduler)
        connect(r.detokenizer)
        monitor.link_changed(r.scheduler)
        await until(lambda: cancelled["n"] == 1)
        await until(lambda: monitor.ready)
        assert reasons(monitor, r) == []
    finally:
        await monitor.stop()
    assert all(task.done() for task in monitor._tasks)


async def test_several_replicas_ready_while_one_can_and_the_router_prefers_it():
    a, b = replica(1), replica(2)
    for link in (a.scheduler, a.detokenizer, b.scheduler, b.detokenizer):
        connect(link)
    peers = Peers()
    peers.answers["10.0.0.1:30020"] = "reports NOT_SERVING"
    monitor = ReadinessMonitor([a, b], lambda _: 0, CONFIG, check=peers.check)
    replicas = ReplicaSet([a, b])
    replicas.can_move_tokens = monitor.can_move_tokens
    monitor.start()
    try:
        await until(lambda: monitor.ready)
        assert monitor.readiness() == tokenizer_pb2.Readiness(ready=True, replicas=2, not_ready=[
            tokenizer_pb2.NotReady(replica="10.0.0.1:30020", reason="scheduler_health_check",
                                   message="the scheduler at 10.0.0.1:30020 reports NOT_SERVING")])
        # Replica a has no outstanding work, yet every prompt goes to b, the one that can move a token.
        assert {replicas.pick([i, i + 1], {}).name for i in range(8)} == {"10.0.0.2:30020"}
        b.detokenizer.up = False
        assert not monitor.ready
        assert [(x.replica, x.reason) for x in monitor.readiness().not_ready] == [
            ("10.0.0.1:30020", "scheduler_health_check"), ("10.0.0.2:30020", "detokenizer_link_down")]
        # None can: requests still go to a replica whose links are up (a stall may end).
        assert replicas.pick([1, 2], {}).name == "10.0.0.1:30020"

        registry = CollectorRegistry()
        registry.register(ReadinessCollector("smol", monitor))
        text = generate_latest(registry).decode()
        assert 'ringserve:ready{model_name="smol"} 0.0' in text
        samples = [line for line in text.splitlines() if line.startswith("ringserve:replica_not_ready{")]
        assert len(samples) == 10  # every reason of both replicas
        ones = sorted(line for line in samples if line.endswith(" 1.0"))
        assert ones == [
            'ringserve:replica_not_ready{model_name="smol",reason="detokenizer_link_down",'
            'replica="10.0.0.2:30020"} 1.0',
            'ringserve:replica_not_ready{model_name="smol",reason="scheduler_health_check",'
            'replica="10.0.0.1:30020"} 1.0',
        ]
    finally:
        await monitor.stop()


async def test_grpc_health_check_serving_not_serving_and_silent():
    server = await start_server("127.0.0.1:0", [])
    silent = socket.socket()  # listens, never accepts: a peer stopped with SIGSTOP looks like this
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    link = replica(1).detokenizer
    try:
        link.channel = insecure_channel(f"127.0.0.1:{server.port}")
        assert await grpc_health_check(link, 2.0) == "reports NOT_SERVING"
        await server.set_serving(True)
        assert await grpc_health_check(link, 2.0) is None
        await link.channel.close()
        link.channel = insecure_channel(f"127.0.0.1:{silent.getsockname()[1]}")
        assert await grpc_health_check(link, 0.3) == "did not answer its health check within 0.3 s"
        await link.channel.close()
        link.channel = None
        assert await grpc_health_check(link, 0.3) == "is not connected"
    finally:
        silent.close()
        await server.stop(0)
