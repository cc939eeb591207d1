"""``ringserve launch``'s options: its own (ports, instance counts, what it hands each
replica), plus every service option marked ``launch``, which it passes on unchanged."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringserve.apikeys import ApiKeys
from ringserve.grpcutil import Transport
from ringserve.internal_auth import InternalAuth
from ringserve.models.gguf import DEFAULT_CACHE
from ringserve.models.packaged import SMOLLM2_DIR
from ringserve.options.common import GRACE_PERIOD, LAUNCH_INTERNAL_AUTH, TRANSPORT, api_keys
from ringserve.options.parse import add_config, add_option, build, check, options
from ringserve.options.scheduler import DEVICE
from ringserve.options.spec import AtLeast, Fraction, option
from ringserve.options.table import SERVICES, PassThrough, pass_through
from ringserve.ports import DEFAULT_GRPC_PORT, DEFAULT_PORT

FREE = "0 (and the others) = a free loopback port"


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """What the launcher itself decides: the model, ports, how many of each service, what each replica gets."""

    model: Path = option(
        "--model", DEFAULT_CACHE / "models" / SMOLLM2_DIR,
        help="HF-format model directory, or a GGUF file: converted once (progress bar) into the cache "
             "($RINGSERVE_CACHE_DIR/models/gguf, keyed by the file's path, size and mtime) and served from there "
             "(default: the packaged SmolLM2-135M-Instruct)")
    host: str = option("--host", "127.0.0.1", help="gateway bind address")
    port: int = option("--port", DEFAULT_PORT, help="gateway HTTP port")
    tokenizer_port: int = option("--tokenizer-port", DEFAULT_GRPC_PORT,
                                 help=f"the first tokenizer's port, the public gRPC API; {FREE}")
    scheduler_port: int = option("--scheduler-port", 0, help=f"the first scheduler's port; {FREE}")
    detokenizer_port: int = option("--detokenizer-port", 0, help=f"the first detokenizer's port; {FREE}")
    # Prometheus /metrics ports of the first instance of each gRPC service; the gateway
    # serves its /metrics on --port.
    tokenizer_metrics_port: int = option("--tokenizer-metrics-port", 0,
                                         help=f"the first tokenizer's Prometheus /metrics port; {FREE}")
    scheduler_metrics_port: int = option("--scheduler-metrics-port", 0,
                                         help=f"the first scheduler's Prometheus /metrics port; {FREE}")
    detokenizer_metrics_port: int = option("--detokenizer-metrics-port", 0,
                                           help=f"the first detokenizer's Prometheus /metrics port; {FREE}")
    device: str = option("--device", "auto", check=DEVICE, metavar="{auto,cpu,cuda,cuda:N}",
                         help="the schedulers' device; auto = the first CUDA device torch sees, else cpu; cuda with "
                              "--replicas N puts replica i on cuda:i (cuda:i*T with --tp-size T)")
    # None: a KV pool size was given (--max-total-tokens, --kv-cache-gib), which each scheduler takes.
    kv_cache_mem_fraction: float | None = option(
        "--kv-cache-mem-fraction", 0.3, check=Fraction(),
        help="without a KV pool size: this share of the available memory for all replicas' KV pools together")
    grace_period_s: float = GRACE_PERIOD.field()
    tokenizers: int = option("--tokenizers", 1, check=AtLeast(1),
                             help="tokenizer instances (the gateway balances over them with gRPC round_robin)")
    replicas: int = option("--replicas", 1, check=AtLeast(1),
                           help="model replicas, each a scheduler with its detokenizer; every tokenizer picks one per "
                                "request (least outstanding work, then prefix affinity)")
    prefill_replicas: int = option(
        "--prefill-replicas", 0, check=AtLeast(0),
        help="prefill/decode disaggregation: this many prefill schedulers (with --decode-replicas; instead of "
             "--replicas); each tokenizer pairs a prefill and a decode scheduler per request (docs/disaggregation.md)")
    decode_replicas: int = option("--decode-replicas", 0, check=AtLeast(0),
                                  help="prefill/decode disaggregation: this many decode schedulers")
    tp_size: int = option("--tp-size", 1, check=AtLeast(1),
                          help="tensor-parallel ranks per replica (one process and device each; the scheduler starts "
                               "them and exits when one is lost)")
    dist_port: int = option("--dist-port", 0,
                            help="scheduler: replica i's tensor-parallel rendezvous port is this + i (0 = a free port)")
    restart_on_failure: bool = option("--restart-on-failure", False,
                                      help="restart a service that exits (same flags and port) instead of stopping all")
    api_keys: ApiKeys = api_keys("the gateway's HTTP API and the tokenizers' gRPC API").field()
    # The ring's internal token (a fresh one by default); empty: --insecure-skip-internal-auth.
    internal_auth: InternalAuth = LAUNCH_INTERNAL_AUTH.field()
    transport: Transport = TRANSPORT.field()  # every service's gRPC servers and channels


def _dest(passed: PassThrough) -> str:
    return "pass" + passed.option.flag


@dataclass(frozen=True)
class Parsed:
    """What ``LaunchParser.parse`` read: the launcher's config, and for each service the
    flags to pass on (``SERVICES``' names), and which of those flags were given."""

    config: Any
    forward: dict[str, tuple[str, ...]]
    given: frozenset[str]


class LaunchParser:
    """The launcher's command line: ``cls``'s own options, then the services' ``launch``
    options, each once, its help prefixed by the services that take it.

    Raises:
        TypeError: a pass-through flag is also one of the launcher's own.
    """

    def __init__(self, cls: type, description: str | None = None):
        self.cls = cls
        self.parser = argparse.ArgumentParser(prog="ringserve launch", description=description)
        self.placed = options(cls)
        mutexes = add_config(self.parser, cls)
        own = {p.option.flag for p in self.placed}
        self.passed = pass_through()
        for passed in self.passed:
            if passed.option.flag in own:
                raise TypeError(f"{passed.option.flag} is the launcher's own and a service's launch option")
            add_option(self.parser, mutexes, passed.placed, _dest(passed), f"{', '.join(passed.services)}: ")

    def parse(self, argv: list[str] | None) -> Parsed:
        """Parse and check ``argv``; a bad value exits with status 2 and the parser's message."""
        args = self.parser.parse_args(argv)
        values = vars(args).copy()
        check(self.parser, values, self.placed)
        check(self.parser, values, [p.placed for p in self.passed], {p.option.flag: _dest(p) for p in self.passed})
        forward: dict[str, list[str]] = {service: [] for service in SERVICES}
        given = set()
        for passed in self.passed:
            value = values[_dest(passed)]
            value = tuple(value) if isinstance(value, list) else value
            if value != passed.option.default:
                given.add(passed.option.flag)
                for service in passed.services:
                    forward[service] += passed.option.argv(value)
        return Parsed(build(self.cls, self.parser, args, values), {s: tuple(w) for s, w in forward.items()},
                      frozenset(given))
