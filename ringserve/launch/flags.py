"""``ringserve launch``'s command line, generated from the option table: the launcher's own
options (``ringserve.options.launch``) and every service option it passes on."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from ringserve.options.launch import LaunchOptions, LaunchParser

KV_POOL_SIZES = frozenset({"--max-total-tokens", "--kv-cache-gib"})


@dataclass(frozen=True, kw_only=True)
class LaunchConfig(LaunchOptions):
    """The launcher's options, and what it passes on to each service.

    Attributes:
        forward: per service ("scheduler", ...), the flags of the options the launcher
            passes on (``Option.launch``) that were given a value other than their default.
    """

    forward: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def passed(self, service: str) -> tuple[str, ...]:
        """The flags ``service`` gets from the launcher's pass-through options."""
        return tuple(self.forward.get(service, ()))


def parse_args(argv: list[str] | None) -> LaunchConfig:
    """Flags -> LaunchConfig. A bad value exits with status 2 and argparse's message."""
    parsed = LaunchParser(LaunchConfig, description="run the whole ring locally as separate processes").parse(argv)
    config: LaunchConfig = parsed.config
    # A KV pool size given goes to every scheduler as it is; no memory share then.
    fraction = None if parsed.given & KV_POOL_SIZES else config.kv_cache_mem_fraction
    if config.prefill_replicas or config.decode_replicas:  # the replicas are the prefill ones, then the decode ones
        if not (config.prefill_replicas and config.decode_replicas) or config.replicas != 1:
            raise SystemExit("ringserve launch: --prefill-replicas and --decode-replicas go together (each at least "
                             "1), without --replicas")
        config = dataclasses.replace(config, replicas=config.prefill_replicas + config.decode_replicas)
    return dataclasses.replace(config, forward=parsed.forward, kv_cache_mem_fraction=fraction)
