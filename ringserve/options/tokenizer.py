"""The tokenizer's options: ``ringserve tokenizer`` (``TokenizerConfig`` in
services/tokenizer/main.py and ``ReadinessConfig`` in services/tokenizer/readiness.py
subclass these)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ringserve.apikeys import ApiKeys
from ringserve.grpcutil import Transport
from ringserve.internal_auth import InternalAuth
from ringserve.options.common import (
    BY_CHART,
    CONTEXT_LENGTH,
    GRACE_PERIOD,
    HOST,
    INSTANCE_ID_BY_CHART,
    INTERNAL_AUTH,
    LOG_REQUESTS,
    METRICS_PORT,
    MODEL,
    SERVED_MODEL_NAME,
    TRANSPORT,
    TracingOptions,
    api_keys,
)
from ringserve.options.spec import Above, AtLeast, ExistingFile, option

EXTRA_ARGS = "a tuning knob: config.tokenizer.extraArgs passes it"
REPLICAS_BY_CHART = f"{BY_CHART}: one --replica per replica pod"
REPLACED_BY_REPLICA = "the chart gives --replica instead, one per replica pod"


@dataclass(frozen=True, kw_only=True)
class ReadinessOptions:
    """Bounds of the readiness checks of each replica, in seconds."""

    check_interval_s: float = option(
        "--readiness-check-interval", 1.0, check=Above(0), chart="config.tokenizer.readinessCheckInterval",
        help="seconds between health checks of each replica's scheduler and detokenizer")
    check_timeout_s: float = option(
        "--readiness-check-timeout", 2.0, check=Above(0), chart="config.tokenizer.readinessCheckTimeout",
        help="a peer that does not answer its health check SERVING within this many seconds makes its replica "
             "not ready")
    stall_s: float = option(
        "--readiness-stall-timeout", 30.0, check=Above(0), chart="config.tokenizer.readinessStallTimeout",
        help="a replica with requests dispatched and no output back for this many seconds is not ready; must "
             "exceed the longest prefill")


@dataclass(frozen=True, kw_only=True)
class TokenizerOptions:
    """One tokenizer instance: its model, its replicas, its public gRPC API."""

    model: Path = MODEL.field()
    host: str = HOST.field()
    port: int = option("--port", 30010, not_in_chart=f"{BY_CHART}: ports.tokenizer",
                       help="the public gRPC API's port (0 picks a free port)")
    scheduler: str = option("--scheduler", "127.0.0.1:30020", not_in_chart=REPLACED_BY_REPLICA,
                            help="scheduler address (of the one replica without --replica)")
    detokenizer: str = option("--detokenizer", "127.0.0.1:30030", not_in_chart=REPLACED_BY_REPLICA,
                              help="detokenizer address (of the one replica without --replica)")
    replicas: tuple[str, ...] = option(
        "--replica", (), metavar="SCHED_ADDR,DETOK_ADDR", not_in_chart=REPLICAS_BY_CHART,
        help="a model replica (a scheduler and its detokenizer); repeat for several; given, it replaces "
             "--scheduler/--detokenizer")
    instance_id: str | None = option(
        "--instance-id", None, not_in_chart=INSTANCE_ID_BY_CHART,
        help="default: tok-<hostname>-<pid>-<random>; must be unique (schedulers and detokenizers refuse a second "
             "stream for a connected id)")
    served_model_name: str | None = SERVED_MODEL_NAME.field()
    context_length: int | None = CONTEXT_LENGTH.field()
    grace_period_s: float = GRACE_PERIOD.field()
    allow_special_tokens_in_messages: bool = option(
        "--allow-special-tokens-in-messages", False, launch=True, chart="config.allowSpecialTokensInMessages",
        help="parse control tokens spelled in chat message text (e.g. <|im_end|>) as those tokens; by default "
             "they are tokenized as plain text")
    chat_template: Path | None = option(
        "--chat-template", None, check=ExistingFile(), metavar="FILE", launch=True,
        not_in_chart=f"{BY_CHART}: config.tokenizer.chatTemplate (the template's text, in a ConfigMap the chart "
                     "makes) or config.tokenizer.chatTemplateConfigMap, mounted at /etc/ringserve/chat-template",
        help="Jinja chat template replacing the model's (e.g. ringserve/templates/chatml_tools.jinja to call tools "
             "with a ChatML model whose template cannot render them)")
    metrics_port: int | None = METRICS_PORT.field()
    transport: Transport = TRANSPORT.field()
    api_keys: ApiKeys = api_keys("every RPC of the Tokenizer service (health and reflection stay open)").field()
    internal_auth: InternalAuth = INTERNAL_AUTH.field()
    readiness: ReadinessOptions = ReadinessOptions()
    log_requests: bool = LOG_REQUESTS.field()
    tracing: TracingOptions = TracingOptions()
    # None: the usable cores, at most 4 (services/tokenizer/workers.py).
    tokenize_workers: int | None = option(
        "--tokenize-workers", None, check=AtLeast(1, say_got=True), metavar="N", not_in_chart=EXTRA_ARGS,
        help="threads that render chat templates and tokenize, off the event loop (default: the usable cores, "
             "at most 4)")
