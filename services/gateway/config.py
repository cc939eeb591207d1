"""The gateway's frozen configuration, parsed once in ``main``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    tokenizer: str = "127.0.0.1:30010"  # the tokenizer service's gRPC address
    api_key: str | None = None  # when set, every route but /health needs "Authorization: Bearer <key>"
    served_model_name: str | None = None  # overrides the tokenizer's served model name
    rpc_timeout_s: float = 5.0  # deadline of the unary calls (model info, tokenize, abort, load)
    health_timeout_s: float = 2.0
    health_generate_timeout_s: float = 20.0  # /health_generate: one token through the ring, else 503
