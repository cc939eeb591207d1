"""The gateway's options: ``ringserve gateway`` (``GatewayConfig`` and ``HttpTimeouts`` in
services/gateway/config.py subclass these)."""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.apikeys import ApiKeys
from ringserve.grpcutil import Transport
from ringserve.options import names
from ringserve.options.common import BY_CHART, GRACE_PERIOD, HOST, LOG_REQUESTS, TRANSPORT, TracingOptions, api_keys
from ringserve.options.spec import Above, AtLeast, option


def _deadline(seconds: float) -> float | None:
    """--request-timeout: <= 0 means no deadline (None)."""
    return seconds if seconds > 0 else None


@dataclass(frozen=True, kw_only=True)
class HttpTimeoutOptions:
    """Read timeouts of one HTTP connection, in seconds (``services.gateway.http_server``)."""

    header_s: float = option("--http-header-timeout", 20.0, check=Above(0), chart="config.gateway.httpHeaderTimeout",
                             help="seconds from a request head's first byte to its end, else HTTP 408 and close")
    body_s: float = option("--http-body-timeout", 30.0, check=Above(0), chart="config.gateway.httpBodyTimeout",
                           help="seconds a request body may stall between two reads, else HTTP 408 and close")
    # Longer than the idle timeout of the proxies in front (ingress-nginx keeps upstream
    # connections 60 s, an AWS ALB 60 s), so that the proxy, not the gateway, closes an idle
    # connection: a proxy reusing one the gateway has just closed fails that request.
    idle_s: float = option("--http-idle-timeout", 75.0, check=Above(0), chart="config.gateway.httpIdleTimeout",
                           help="seconds a connection may stay open with no request in progress (after accept or a "
                                "response) before it is closed")


@dataclass(frozen=True, kw_only=True)
class GatewayOptions:
    """The OpenAI-compatible HTTP front: where it listens, its tokenizers, limits, output parsing."""

    host: str = HOST.field()
    port: int = option("--port", 8000, not_in_chart=f"{BY_CHART}: ports.gateway", help="HTTP port")
    tokenizer: str = option("--tokenizer", "127.0.0.1:30010", help="gRPC address of the tokenizer service",
                            not_in_chart=f"{BY_CHART}: the tokenizer Service's DNS name (round_robin over its pods)")
    # Non-empty: every route but the probes and /metrics needs "Authorization: Bearer <key>" with one
    # of these keys, and the first is presented to the tokenizer on every call.
    api_keys: ApiKeys = api_keys("the API routes (the first key is also sent to the tokenizer)").field()
    served_model_name: str | None = option(
        "--served-model-name", None, not_in_chart=f"{BY_CHART}: model.servedModelName when set",
        help="model name to serve (default: the tokenizer's served model name)")
    # Deadline of each generation's Generate call (HTTP 504 timeout_error when it passes);
    # None: no deadline. Ten minutes lets a long CPU generation finish under load.
    request_timeout_s: float | None = option(
        "--request-timeout", 600.0, convert=_deadline, launch=True, chart="config.gateway.requestTimeout",
        help="seconds a generation may take before it is aborted with HTTP 504 (the Generate call's gRPC "
             "deadline; <= 0: none)")
    max_request_body_bytes: int = option(
        "--max-request-body-bytes", 16 * 1024 * 1024, check=Above(0), launch=True,
        chart="config.gateway.maxRequestBodyBytes", help="larger request bodies get HTTP 413 before parsing")
    log_requests: bool = LOG_REQUESTS.field()
    # On SIGTERM: new requests get 503, in-flight ones this long to finish (services.gateway.drain).
    grace_period_s: float = GRACE_PERIOD.field()
    tool_call_parser: str | None = option(
        "--tool-call-parser", None, choices=(*names.TOOL_CALL_PARSERS, "none"), launch=True,
        chart="config.gateway.toolCallParser",
        help="format of the model's own tool calls under tool_choice auto: hermes (<tool_call> JSON: Hermes, "
             "Qwen2.5/3, chatml_tools.jinja), llama3_json (Llama 3.x), mistral ([TOOL_CALLS]), pythonic "
             "([f(a=1)]); none = leave them in content (default: the one the tokenizer reports for the chat "
             "template it chose, hermes for the shipped chatml_tools.jinja; else hermes)")
    reasoning_parser: str | None = option(
        "--reasoning-parser", None, choices=names.REASONING_PARSERS, launch=True,
        chart="config.gateway.reasoningParser",
        help="split <think>...</think> into reasoning_content: deepseek_r1 (the opening tag may be in the prompt) "
             "or qwen3 (default: off)")
    # The store of finished /v1/responses for GET/DELETE and previous_response_id: an LRU in each
    # gateway process (replicas do not share it), bounded by count and by JSON bytes.
    responses_store_max: int = option(
        "--responses-store-max", 1000, check=AtLeast(0), launch=True, chart="config.gateway.responsesStoreMax",
        help="most finished /v1/responses kept in this gateway's memory for GET, DELETE and previous_response_id "
             "(least recently used go first); 0: none are stored, and store: true or previous_response_id is "
             "refused")
    responses_store_max_bytes: int = option(
        "--responses-store-max-bytes", 256 * 1024 * 1024, check=Above(0), launch=True,
        chart="config.gateway.responsesStoreMaxBytes",
        help="most bytes of JSON the stored /v1/responses may hold (each counts its response and whole "
             "conversation); least recently used go first")
    # Below the idle timeouts of the proxies in front (nginx's proxy_read_timeout and an AWS
    # ALB's idle timeout are 60 s, many others 30-60 s), so a stream waiting in the queue or
    # in a long prefill is never cut for silence.
    sse_keepalive_s: float = option(
        "--sse-keepalive-s", 15.0, check=AtLeast(0), launch=True, chart="config.gateway.sseKeepalive",
        help="seconds a stream may stay silent before an SSE comment (': keepalive') is sent, also while it "
             "waits for its first token; 0: never")
    # A pod that runs a whole ring is one endpoint of an InferencePool: the picker scrapes the
    # gateway's port, so /metrics carries the scheduler's families too (metrics_upstream.py).
    metrics_upstreams: tuple[str, ...] = option(
        "--metrics-upstream", (), metavar="URL",
        not_in_chart=f"{BY_CHART}: the pod's scheduler /metrics under inferencePool.enabled",
        help="also serve this Prometheus endpoint's metrics on /metrics, fetched at each scrape (the scheduler's "
             "http://127.0.0.1:PORT/metrics in a pod that runs a whole ring); repeat for several")
    transport: Transport = TRANSPORT.field()
    http_timeouts: HttpTimeoutOptions = HttpTimeoutOptions()
    tracing: TracingOptions = TracingOptions()
