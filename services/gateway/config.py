"""The gateway's frozen configuration, parsed once in ``main``.

Every flag is a field declared in the option table (``ringserve.options.gateway``), with its
default, help and choices; these subclasses add what no flag sets.
"""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.options.gateway import GatewayOptions, HttpTimeoutOptions


@dataclass(frozen=True, kw_only=True)
class HttpTimeouts(HttpTimeoutOptions):
    """Read timeouts of one HTTP connection, in seconds (``services.gateway.http_server``)."""


@dataclass(frozen=True, kw_only=True)
class GatewayConfig(GatewayOptions):
    """The gateway; the flags' fields are ``GatewayOptions``'."""

    rpc_timeout_s: float = 5.0  # deadline of the unary calls (model info, tokenize, abort, load)
    health_timeout_s: float = 2.0
    health_generate_timeout_s: float = 20.0  # /health_generate: one token through the ring, else 503
    http_timeouts: HttpTimeouts = HttpTimeouts()  # idle, request-head and request-body read timeouts
