"""``ringserve gateway``: parse flags once into a GatewayConfig and serve the app with uvicorn,
draining on SIGTERM (``services.gateway.drain``)."""

from __future__ import annotations

import functools
import logging

from ringserve import grpcutil, tracing
from ringserve.options.parse import ConfigParser

from .app import create_app
from .config import GatewayConfig
from .drain import serve
from .http_server import TimedH11Protocol
from .request_context import RequestLogFilter


def parse_args(argv: list[str] | None) -> GatewayConfig:
    """Flags -> GatewayConfig (the option table, ``ringserve.options.gateway``). A bad value
    exits with status 2 and argparse's message."""
    cli = ConfigParser(GatewayConfig, prog="ringserve gateway",
                       description="The OpenAI-compatible HTTP gateway in front of the tokenizer service.")
    return cli.build(*cli.parse(argv))


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    grpcutil.configure(config.transport)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s gateway: %(request_tag)s%(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestLogFilter())
    tracing.setup("gateway", config.tracing)
    app = create_app(config)
    serve(
        app,
        app.state.drain,
        config.grace_period_s,
        host=config.host,
        port=config.port,
        loop="uvloop",
        # h11 frames responses by the request's HTTP version (see http_server).
        http=functools.partial(TimedH11Protocol, timeouts=config.http_timeouts),
        log_level="warning",
        timeout_keep_alive=config.http_timeouts.idle_s,
    )


if __name__ == "__main__":
    main()
