"""Options several services share (one declaration, the same flag and help in each), and
the flag groups whose own modules parse them (gRPC transport, API keys, internal credential)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ringserve import grpcutil
from ringserve.apikeys import ApiKeys, add_api_key_args, api_keys_from_args
from ringserve.internal_auth import InternalAuth, add_internal_auth_args, internal_auth_from_args
from ringserve.options.spec import Fraction, Group, Option, option

BY_CHART = "set by the chart"  # the start of a not_in_chart reason: the chart passes it itself

HOST = Option("--host", "127.0.0.1", help="address to listen on (0.0.0.0: every interface)",
              not_in_chart=f"{BY_CHART}: 0.0.0.0, every pod listens on its own address")
MODEL = Option("--model", help="HF-format model directory (config.json, *.safetensors, tokenizer.json), or a GGUF "
                               "file: converted once into the cache ($RINGSERVE_CACHE_DIR) and reused",
               not_in_chart=f"{BY_CHART}: /models/<model.name>, prepared by the init container (model.source)")
GRACE_PERIOD = Option("--grace-period", 5.0, help="seconds in-flight requests get to finish on SIGTERM",
                      chart="config.gracePeriod")
SERVED_MODEL_NAME = Option(
    "--served-model-name", None, launch=True,
    help="the model's name in the API and the metrics' model_name label (default: the model directory's name)",
    not_in_chart=f"{BY_CHART}: model.servedModelName, else model.name",
)
CONTEXT_LENGTH = Option("--context-length", None, launch=True, chart="config.contextLength",
                        help="most tokens of a prompt and its completion (default: the model's "
                             "max_position_embeddings)")
METRICS_PORT = Option("--metrics-port", None,
                      help="Prometheus GET /metrics HTTP port on --host (0 = a free port; default: no endpoint)",
                      not_in_chart=f"{BY_CHART}: ports.<service>Metrics")
INSTANCE_ID_BY_CHART = f"{BY_CHART}: the pod's name"
LOG_REQUESTS = Option(
    "--log-requests", False, launch=True, chart="config.logRequests",
    help="log each request under its rid (the X-Request-Id): the gateway its prompt and output texts, the other "
         "services its life cycle (tokens, finish reason, aborts); by default no prompt or output is written to the "
         "log")


@dataclass(frozen=True, kw_only=True)
class TracingOptions:
    """OpenTelemetry tracing (``ringserve.tracing``); every service has these, and the launcher passes them on."""

    otlp_traces_endpoint: str | None = option(
        "--otlp-traces-endpoint", None, launch=True, chart="config.tracing.otlpTracesEndpoint",
        help="export trace spans over OTLP/gRPC to this collector (http://host:4317, or host:4317: plaintext; "
             "https://host:4317: TLS); default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else tracing is off")
    otlp_traces_sample_ratio: float | None = option(
        "--otlp-traces-sample-ratio", None, check=Fraction(up_to_one=True), launch=True,
        chart="config.tracing.sampleRatio",
        help="share of the traces this service starts that are recorded; a request that arrives with a trace "
             "context follows its sampled flag (parent-based); default: $OTEL_TRACES_SAMPLER / "
             "$OTEL_TRACES_SAMPLER_ARG, else every trace")

TRANSPORT = Group(grpcutil.add_transport_args, grpcutil.transport_from_args, grpcutil.Transport)
INTERNAL_AUTH = Group(add_internal_auth_args, internal_auth_from_args, InternalAuth)
# The launcher's: a fresh credential per ring unless one is given.
LAUNCH_INTERNAL_AUTH = Group(functools.partial(add_internal_auth_args, launcher=True),
                             functools.partial(internal_auth_from_args, generate=True), InternalAuth.generate)


def api_keys(what: str) -> Group:
    """``--api-key``/``--api-key-file``; ``what`` names the surface they protect in the help."""
    return Group(functools.partial(add_api_key_args, what=what), api_keys_from_args, ApiKeys)
