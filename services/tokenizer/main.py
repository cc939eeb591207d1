"""``ringserve tokenizer``: flags, start-up, health and shutdown of the tokenizer service.

Flags are parsed once into ``TokenizerConfig``. The instance talks to one or more
model replicas (``--replica SCHED_ADDR,DETOK_ADDR``, repeatable; by default the one
pair ``--scheduler``/``--detokenizer``) and picks one per request
(``services.tokenizer.router``). Health reports SERVING once the tokenizer is
loaded and at least one replica can move a token (both links up, both peers answering
their health checks, outputs not stalled: ``services.tokenizer.readiness``), and
NOT_SERVING while none can; ``GetReadiness`` says why, and the health service
``liveness`` stays SERVING meanwhile. Losing one replica's link fails only the requests
dispatched to that replica. SIGTERM and SIGINT turn health
NOT_SERVING and stop accepting calls; in-flight calls get ``--grace-period``
seconds to finish (the links stay up meanwhile), then the rest are cancelled (which
aborts them at their scheduler), pending aborts are flushed and the links closed.

With API keys (``--api-key``, ``--api-key-file``, ``$RINGSERVE_API_KEY``; see
``ringserve.apikeys``) every RPC of the ``Tokenizer`` service needs
``authorization: Bearer <key>`` metadata, else it ends UNAUTHENTICATED before any work;
health and reflection stay open. Its calls to the schedulers and detokenizers present the
ring's internal credential (``ringserve.internal_auth``: ``$RINGSERVE_INTERNAL_TOKEN`` or
``--internal-token-file``), a different secret.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ringserve import grpcutil
from ringserve.apikeys import ApiKeyInterceptor, ApiKeys, add_api_key_args, api_keys_from_args
from ringserve.grpcutil import ServingServer, start_server
from ringserve.internal_auth import InternalAuth, add_internal_auth_args, internal_auth_from_args
from ringserve.metrics import ServiceMetrics, add_metrics_port_flag
from ringserve.models import resolve_model
from ringserve.v1 import tokenizer_pb2_grpc
from services.tokenizer.errors import unavailable
from services.tokenizer.links import DetokenizerLink, Link, SchedulerLink
from services.tokenizer.manager import TokenizerManager
from services.tokenizer.metrics import install_tokenizer_metrics
from services.tokenizer.replicas import Replica, ReplicaAddress, ReplicaSet
from services.tokenizer.model import load_tokenizer, model_facts
from services.tokenizer.readiness import ReadinessConfig, ReadinessMonitor
from services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer

logger = logging.getLogger(__name__)

ABORT_FLUSH_S = 0.5


def default_instance_id() -> str:
    """``tok-<host>-<pid>-<12 hex digits>``: the random part keeps two instances apart even where
    host and pid repeat (containers, where every process may be pid 1 on the same host name)."""
    return f"tok-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class TokenizerConfig:
    """Configuration of one tokenizer instance (one field per flag)."""

    model: Path
    host: str = "127.0.0.1"
    port: int = 30010  # 0 picks a free port
    scheduler: str = "127.0.0.1:30020"
    detokenizer: str = "127.0.0.1:30030"
    # "SCHED_ADDR,DETOK_ADDR" per model replica; empty: the one replica scheduler + detokenizer.
    replicas: tuple[str, ...] = ()
    instance_id: str = field(default_factory=default_instance_id)
    served_model_name: str | None = None  # default: the model directory's name
    context_length: int | None = None  # default: config.json max_position_embeddings
    grace_period_s: float = 5.0  # on SIGTERM, how long in-flight calls may run on
    allow_special_tokens_in_messages: bool = False  # control tokens spelled in messages stay text
    chat_template: Path | None = None  # a Jinja chat template file replacing the model's
    metrics_port: int | None = None  # Prometheus /metrics on host:port; None = off, 0 = a free port
    transport: grpcutil.Transport = grpcutil.Transport()  # message size and TLS, server and both links
    api_keys: ApiKeys = ApiKeys()  # keys the Tokenizer service requires; empty: none
    internal_auth: InternalAuth = InternalAuth()  # presented to the schedulers and detokenizers; empty: none
    readiness: ReadinessConfig = ReadinessConfig()  # health-check interval and timeout, stall bound

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def replica_addresses(self) -> tuple[ReplicaAddress, ...]:
        """Every replica's addresses. Raises ValueError for a malformed ``replicas`` entry."""
        if not self.replicas:
            return (ReplicaAddress(self.scheduler, self.detokenizer),)
        return tuple(ReplicaAddress.parse(spec) for spec in self.replicas)


class TokenizerService:
    """The manager, the links of every replica and the gRPC server, started and stopped together."""

    def __init__(self, config: TokenizerConfig):
        self.config = config
        tokenizer = load_tokenizer(config.model)
        if config.chat_template is not None:
            tokenizer.chat_template = config.chat_template.read_text()
        facts = model_facts(config.model, tokenizer, config.served_model_name, config.context_length)
        self.manager = TokenizerManager(
            tokenizer, facts, config.instance_id,
            allow_special_tokens_in_messages=config.allow_special_tokens_in_messages,
        )
        self.replicas = ReplicaSet([
            Replica(address, config.instance_id, self.manager.handle_batch, self._on_link,
                    config.internal_auth.metadata())
            for address in config.replica_addresses
        ])
        self.manager.balancer = self.replicas
        self.readiness = ReadinessMonitor(
            self.replicas.replicas, lambda replica: self.manager.outstanding.get(replica, 0), config.readiness,
            on_change=lambda _ready: asyncio.get_running_loop().create_task(self._sync_health()),
        )
        self.replicas.can_move_tokens = self.readiness.can_move_tokens
        self.server: ServingServer | None = None
        self.metrics = ServiceMetrics(facts.served_model_name)

    @property
    def scheduler(self) -> SchedulerLink:
        """The first replica's scheduler link."""
        return self.replicas.replicas[0].scheduler

    @property
    def detokenizer(self) -> DetokenizerLink:
        """The first replica's detokenizer link."""
        return self.replicas.replicas[0].detokenizer

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def ready(self) -> bool:
        return self.readiness.ready

    def _on_link(self, link: Link, up: bool) -> None:
        replica = self.replicas.of(link)
        if not up:
            failed = self.manager.fail_all(
                unavailable(f"lost the connection to the {link.name} at {link.target}"),
                send_aborts=link is replica.detokenizer,
                replica=replica,
            )
            if link is replica.scheduler:  # it may have restarted with an empty prefix cache
                self.replicas.router.forget(replica.name)
            logger.warning("%s link down; failed %d in-flight requests", link.name, failed)
        else:
            logger.info("%s link up (%s)", link.name, link.target)
        self.readiness.link_changed(link)
        asyncio.get_running_loop().create_task(self._sync_health())

    async def _sync_health(self) -> None:
        if self.server is not None:
            await self.server.set_serving(self.ready)

    async def start(self) -> None:
        servicer = TokenizerServicer(
            self.manager,
            lambda: [r.scheduler.last_load for r in self.replicas.replicas],
            lambda: asyncio.gather(*(r.loads() for r in self.replicas.replicas)),
            self.readiness.readiness,
        )
        install_tokenizer_metrics(self.metrics, self.manager, [r.scheduler for r in self.replicas.replicas], servicer,
                                  self.readiness)
        self.metrics.serve(self.config.host, self.config.metrics_port)
        interceptors = [ApiKeyInterceptor(self.config.api_keys, (SERVICE_NAME,))] if self.config.api_keys else []
        self.server = await start_server(
            self.config.address, [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, servicer, SERVICE_NAME)],
            interceptors=interceptors,
        )
        for replica in self.replicas.replicas:
            replica.start()
        self.readiness.start()
        logger.info("tokenizer %s listening on %s:%d, replicas %s, %s", self.config.instance_id, self.config.host,
                    self.port, ", ".join(f"{r.address.scheduler}+{r.address.detokenizer}" for r in self.replicas.replicas),
                    f"API key required ({len(self.config.api_keys.keys)} valid)" if self.config.api_keys else "no API key")

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.set_serving(False)
            await self.server.stop(self.config.grace_period_s)
        await asyncio.gather(*(r.scheduler.flush(ABORT_FLUSH_S) for r in self.replicas.replicas))
        await self.readiness.stop()
        for replica in self.replicas.replicas:
            await replica.detokenizer.stop()
            await replica.scheduler.stop()
        self.metrics.stop()


def parse_args(argv: list[str] | None = None) -> TokenizerConfig:
    p = argparse.ArgumentParser(prog="ringserve tokenizer", description="The tokenizer service (public gRPC API).")
    p.add_argument("--model", type=Path, required=True,
                   help="HF-format model directory, or a GGUF file (its conversion in the cache, made once)")
    p.add_argument("--host", default=TokenizerConfig.host)
    p.add_argument("--port", type=int, default=TokenizerConfig.port, help="0 picks a free port")
    p.add_argument("--scheduler", default=TokenizerConfig.scheduler, help="scheduler address")
    p.add_argument("--detokenizer", default=TokenizerConfig.detokenizer, help="detokenizer address")
    p.add_argument("--replica", action="append", default=[], metavar="SCHED_ADDR,DETOK_ADDR",
                   help="a model replica (a scheduler and its detokenizer); repeat for several; "
                        "given, it replaces --scheduler/--detokenizer")
    p.add_argument("--instance-id", default=None,
                   help="default: tok-<hostname>-<pid>-<random>; must be unique (schedulers and detokenizers "
                        "refuse a second stream for a connected id)")
    p.add_argument("--served-model-name", default=None, help="default: the model directory's name")
    p.add_argument("--context-length", type=int, default=None, help="default: config.json max_position_embeddings")
    p.add_argument("--grace-period", type=float, default=TokenizerConfig.grace_period_s,
                   help="seconds in-flight calls get to finish on SIGTERM")
    p.add_argument("--allow-special-tokens-in-messages", action="store_true",
                   help="parse control tokens spelled in chat message text (e.g. <|im_end|>) as those "
                        "tokens; by default they are tokenized as plain text")
    p.add_argument("--chat-template", type=Path, default=None, metavar="FILE",
                   help="Jinja chat template replacing the model's (e.g. ringserve/templates/chatml_tools.jinja "
                        "to call tools with a ChatML model whose template cannot render them)")
    r = ReadinessConfig()
    p.add_argument("--readiness-check-interval", type=float, default=r.check_interval_s,
                   help="seconds between health checks of each replica's scheduler and detokenizer (default %(default)s)")
    p.add_argument("--readiness-check-timeout", type=float, default=r.check_timeout_s,
                   help="a peer that does not answer its health check SERVING within this many seconds makes its "
                        "replica not ready (default %(default)s)")
    p.add_argument("--readiness-stall-timeout", type=float, default=r.stall_s,
                   help="a replica with requests dispatched and no output back for this many seconds is not ready; "
                        "must exceed the longest prefill (default %(default)s)")
    add_metrics_port_flag(p)
    grpcutil.add_transport_args(p)
    add_api_key_args(p, "every RPC of the Tokenizer service (health and reflection stay open)")
    add_internal_auth_args(p)
    a = p.parse_args(argv)
    for flag in ("check_interval", "check_timeout", "stall_timeout"):
        if getattr(a, f"readiness_{flag}") <= 0:
            p.error(f"--readiness-{flag.replace('_', '-')} must be > 0")
    if a.chat_template is not None and not a.chat_template.is_file():
        p.error(f"--chat-template {a.chat_template}: no such file")
    for spec in a.replica:
        try:
            ReplicaAddress.parse(spec)
        except ValueError as exc:
            p.error(str(exc))
    return TokenizerConfig(
        model=resolve_model(a.model),
        host=a.host,
        port=a.port,
        scheduler=a.scheduler,
        detokenizer=a.detokenizer,
        replicas=tuple(a.replica),
        instance_id=a.instance_id or default_instance_id(),
        served_model_name=a.served_model_name,
        context_length=a.context_length,
        grace_period_s=a.grace_period,
        allow_special_tokens_in_messages=a.allow_special_tokens_in_messages,
        chat_template=a.chat_template,
        metrics_port=a.metrics_port,
        transport=grpcutil.transport_from_args(p, a),
        api_keys=api_keys_from_args(p, a),
        internal_auth=internal_auth_from_args(p, a),
        readiness=ReadinessConfig(a.readiness_check_interval, a.readiness_check_timeout, a.readiness_stall_timeout),
    )


async def serve(config: TokenizerConfig) -> None:
    """Run until SIGTERM or SIGINT."""
    service = TokenizerService(config)
    await service.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logger.info("tokenizer stopping")
    await service.stop()


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    grpcutil.configure(config.transport)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s tokenizer %(name)s: %(message)s")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
