"""``ringserve tokenizer``: flags, start-up, health and shutdown of the tokenizer service.

Flags are parsed once into ``TokenizerConfig``. The instance talks to one or more
model replicas (``--replica SCHED_ADDR,DETOK_ADDR``, repeatable; by default the one
pair ``--scheduler``/``--detokenizer``) and picks one per request
(``services.tokenizer.router``). Health reports SERVING once the tokenizer is
loaded and at least one replica can move a token (both links up, both peers answering
their health checks, outputs not stalled: ``services.tokenizer.readiness``), and
NOT_SERVING while none can; ``GetReadiness`` says why, and the health service
``liveness`` stays SERVING meanwhile. Losing one replica's link fails only the requests
dispatched to that replica. Chat rendering and tokenization run on ``--tokenize-workers``
threads, so health and every other call keep being answered while a large prompt is
tokenized (``services.tokenizer.workers``). SIGTERM and SIGINT turn health
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

import asyncio
import gc
import logging
import os
import signal
import socket
import uuid
from dataclasses import dataclass, field

from ringserve import grpcutil, tracing
from ringserve.apikeys import ApiKeyInterceptor
from ringserve.grpcutil import ServingServer, start_server
from ringserve.metrics import ServiceMetrics
from ringserve.models.gguf import resolve_model
from ringserve.options.parse import ConfigParser
from ringserve.options.tokenizer import TokenizerOptions
from ringserve.v1 import tokenizer_pb2_grpc
from services.tokenizer.chat_template import choose_chat_template
from services.tokenizer.errors import unavailable
from services.tokenizer.kv_relay import KvEventRelay
from services.tokenizer.links import DetokenizerLink, Link, SchedulerLink
from services.tokenizer.manager import TokenizerManager
from services.tokenizer.metrics import install_tokenizer_metrics
from services.tokenizer.model import load_tokenizer, model_facts
from services.tokenizer.readiness import ReadinessConfig, ReadinessMonitor
from services.tokenizer.replicas import Replica, ReplicaAddress, ReplicaSet
from services.tokenizer.servicer import SERVICE_NAME, TokenizerServicer
from services.tokenizer.workers import Workers, default_workers, thread_pool

logger = logging.getLogger(__name__)

ABORT_FLUSH_S = 0.5


def default_instance_id() -> str:
    """``tok-<host>-<pid>-<12 hex digits>``: the random part keeps two instances apart even where
    host and pid repeat (containers, where every process may be pid 1 on the same host name)."""
    return f"tok-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, kw_only=True)
class TokenizerConfig(TokenizerOptions):
    """Configuration of one tokenizer instance; every field is a flag (``TokenizerOptions``)."""

    instance_id: str = field(default_factory=default_instance_id)
    readiness: ReadinessConfig = ReadinessConfig()  # health-check interval and timeout, stall bound
    # threads that render and tokenize, off the event loop (services/tokenizer/workers.py)
    tokenize_workers: int = field(default_factory=default_workers)

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
        template = choose_chat_template(tokenizer, config.chat_template)
        facts = model_facts(config.model, tokenizer, config.served_model_name, config.context_length,
                            template.tool_call_parser)
        self.manager = TokenizerManager(
            tokenizer, facts, config.instance_id,
            allow_special_tokens_in_messages=config.allow_special_tokens_in_messages,
            workers=Workers(thread_pool(config.tokenize_workers)),
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
            KvEventRelay(self.replicas.replicas),
            log_requests=self.config.log_requests,
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
        replicas = ", ".join(f"{r.address.scheduler}+{r.address.detokenizer}" for r in self.replicas.replicas)
        keys = f"API key required ({len(self.config.api_keys.keys)} valid)" if self.config.api_keys else "no API key"
        logger.info("tokenizer %s listening on %s:%d, replicas %s, %s", self.config.instance_id, self.config.host,
                    self.port, replicas, keys)
        bounds = self.manager.bounds
        logger.info("%d tokenize workers; prompts over %s characters or %d messages are refused before tokenizing",
                    self.config.tokenize_workers, bounds.max_prompt_chars or "(no bound)", bounds.max_prompt_tokens)

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.set_serving(False)
            await self.server.stop(self.config.grace_period_s)
        await asyncio.gather(*(r.scheduler.flush(ABORT_FLUSH_S) for r in self.replicas.replicas))
        await self.readiness.stop()
        for replica in self.replicas.replicas:
            await replica.detokenizer.stop()
            await replica.scheduler.stop()
        self.manager.workers.shutdown()
        self.metrics.stop()


def parse_args(argv: list[str] | None = None) -> TokenizerConfig:
    """Flags -> TokenizerConfig (the option table, ``ringserve.options.tokenizer``). A bad value
    exits with status 2 and argparse's message."""
    cli = ConfigParser(TokenizerConfig, prog="ringserve tokenizer",
                       description="The tokenizer service (public gRPC API).")
    args, values = cli.parse(argv)
    for spec in values["replicas"]:
        try:
            ReplicaAddress.parse(spec)
        except ValueError as exc:
            cli.error(str(exc))
    values["model"] = resolve_model(values["model"])
    return cli.build(args, values)


async def serve(config: TokenizerConfig) -> None:
    """Run until SIGTERM or SIGINT."""
    service = TokenizerService(config)
    await service.start()
    # Start-up objects (transformers, the vocabulary) are never garbage: a full collection
    # that walked them would stall the event loop (measured ~100 ms in the lighter gateway).
    gc.freeze()
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
    tracing.setup("tokenizer", config.tracing)
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
