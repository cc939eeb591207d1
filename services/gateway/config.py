"""The gateway's frozen configuration, parsed once in ``main``."""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.apikeys import ApiKeys
from ringserve.grpcutil import Transport


@dataclass(frozen=True)
class HttpTimeouts:
    """Read timeouts of one HTTP connection, in seconds (``services.gateway.http_server``)."""

    header_s: float = 20.0
    body_s: float = 30.0
    # Longer than the idle timeout of the proxies in front (ingress-nginx keeps upstream
    # connections 60 s, an AWS ALB 60 s), so that the proxy, not the gateway, closes an idle
    # connection: a proxy reusing one the gateway has just closed fails that request.
    idle_s: float = 75.0


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    tokenizer: str = "127.0.0.1:30010"  # the tokenizer service's gRPC address
    # Non-empty: every route but the probes and /metrics needs "Authorization: Bearer <key>" with one
    # of these keys, and the first is presented to the tokenizer on every call.
    api_keys: ApiKeys = ApiKeys()
    served_model_name: str | None = None  # overrides the tokenizer's served model name
    rpc_timeout_s: float = 5.0  # deadline of the unary calls (model info, tokenize, abort, load)
    health_timeout_s: float = 2.0
    health_generate_timeout_s: float = 20.0  # /health_generate: one token through the ring, else 503
    # Deadline of each generation's Generate call (HTTP 504 timeout_error when it passes);
    # None: no deadline. Ten minutes lets a long CPU generation finish under load.
    request_timeout_s: float | None = 600.0
    max_request_body_bytes: int = 16 * 1024 * 1024  # larger bodies: 413, before any parsing
    log_requests: bool = False  # log prompts and outputs (INFO); off: they never reach a log
    tool_call_parser: str = "hermes"  # the model's own tool-call format under tool_choice auto; "none": off
    reasoning_parser: str | None = None  # <think> format (deepseek_r1, qwen3); None: no reasoning parsing
    transport: Transport = Transport()  # gRPC message size and TLS of the channel to the tokenizer
    http_timeouts: HttpTimeouts = HttpTimeouts()  # idle, request-head and request-body read timeouts
