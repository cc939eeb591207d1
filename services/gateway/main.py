"""``ringserve gateway``: parse flags once into a GatewayConfig and serve the app with uvicorn."""

from __future__ import annotations

import argparse
import functools
import logging

import uvicorn

from ringserve import grpcutil
from ringserve.apikeys import add_api_key_args, api_keys_from_args

from .app import create_app
from .config import GatewayConfig, HttpTimeouts
from .http_server import TimedH11Protocol
from .reasoning import REASONING_PARSERS
from .tool_parsers import TOOL_CALL_PARSERS


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
    add_api_key_args(parser, "the API routes (the first key is also sent to the tokenizer)")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model name to serve (default: the tokenizer's served model name)",
    )
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s,
                        help="seconds a generation may take before it is aborted with HTTP 504 "
                             "(the Generate call's gRPC deadline; <= 0: none; default %(default)s)")
    parser.add_argument("--max-request-body-bytes", type=int, default=defaults.max_request_body_bytes,
                        help="larger request bodies get HTTP 413 before parsing (default %(default)s)")
    parser.add_argument("--log-requests", action="store_true",
                        help="log prompts and outputs; by default they are never written to the log")
    parser.add_argument("--tool-call-parser", default=defaults.tool_call_parser,
                        choices=[*TOOL_CALL_PARSERS, "none"],
                        help="format of the model's own tool calls under tool_choice auto: hermes "
                             "(<tool_call> JSON: Hermes, Qwen2.5/3, chatml_tools.jinja), llama3_json "
                             "(Llama 3.x), mistral ([TOOL_CALLS]), pythonic ([f(a=1)]); none = leave them "
                             "in content (default %(default)s)")
    parser.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                        help="split <think>...</think> into reasoning_content: deepseek_r1 (the opening tag "
                             "may be in the prompt) or qwen3 (default: off)")
    http = defaults.http_timeouts
    parser.add_argument("--http-header-timeout", type=float, default=http.header_s,
                        help="seconds from a request head's first byte to its end, else HTTP 408 and close "
                             "(default %(default)s)")
    parser.add_argument("--http-body-timeout", type=float, default=http.body_s,
                        help="seconds a request body may stall between two reads, else HTTP 408 and close "
                             "(default %(default)s)")
    parser.add_argument("--http-idle-timeout", type=float, default=http.idle_s,
                        help="seconds a connection may stay open with no request in progress (after accept or a "
                             "response) before it is closed (default %(default)s)")
    grpcutil.add_transport_args(parser)
    args = parser.parse_args(argv)
    if args.max_request_body_bytes <= 0:
        parser.error("--max-request-body-bytes must be > 0")
    for flag in ("header", "body", "idle"):
        if getattr(args, f"http_{flag}_timeout") <= 0:
            parser.error(f"--http-{flag}-timeout must be > 0")
    return GatewayConfig(
        host=args.host,
        port=args.port,
        tokenizer=args.tokenizer,
        api_keys=api_keys_from_args(parser, args),
        served_model_name=args.served_model_name,
        request_timeout_s=args.request_timeout if args.request_timeout and args.request_timeout > 0 else None,
        max_request_body_bytes=args.max_request_body_bytes,
        log_requests=args.log_requests,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        transport=grpcutil.transport_from_args(parser, args),
        http_timeouts=HttpTimeouts(args.http_header_timeout, args.http_body_timeout, args.http_idle_timeout),
    )


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    grpcutil.configure(config.transport)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s gateway: %(message)s")
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        loop="uvloop",
        # h11 frames responses by the request's HTTP version (see http_server).
        http=functools.partial(TimedH11Protocol, timeouts=config.http_timeouts),  # type: ignore[arg-type]
        log_level="warning",
        timeout_keep_alive=config.http_timeouts.idle_s,  # type: ignore[arg-type]
    )


if __name__ == "__main__":
    main()
