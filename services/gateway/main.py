"""``ringserve gateway``: parse flags once into a GatewayConfig and serve the app with uvicorn."""

from __future__ import annotations

import argparse
import logging

import uvicorn

from .app import create_app
from .config import GatewayConfig


def parse_args(argv: list[str] | None) -> GatewayConfig:
    defaults = GatewayConfig()
    parser = argparse.ArgumentParser(
        prog="ringserve gateway",
        description="The OpenAI-compatible HTTP gateway in front of the tokenizer service.",
    )
    parser.add_argument("--host", default=defaults.host, help="HTTP bind address (default %(default)s)")
    parser.add_argument("--port", type=int, default=defaults.port, help="HTTP port (default %(default)s)")
    parser.add_argument(
        "--tokenizer",
        default=defaults.tokenizer,
        help="gRPC address of the tokenizer service (default %(default)s)",
    )
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer <key>' on the API routes")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model name to serve (default: the tokenizer's served model name)",
    )
    args = parser.parse_args(argv)
    return GatewayConfig(
        host=args.host,
        port=args.port,
        tokenizer=args.tokenizer,
        api_key=args.api_key,
        served_model_name=args.served_model_name,
    )


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s gateway: %(message)s")
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        timeout_keep_alive=30,
    )


if __name__ == "__main__":
    main()
