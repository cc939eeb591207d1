"""The whole table: each service's options, and the ones ``ringserve launch`` passes on."""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.options.detokenizer import DetokenizerOptions
from ringserve.options.gateway import GatewayOptions
from ringserve.options.parse import Placed, options
from ringserve.options.scheduler import SchedulerOptions
from ringserve.options.spec import Option
from ringserve.options.tokenizer import TokenizerOptions

# In the order the launcher starts them.
SERVICES: dict[str, type] = {
    "detokenizer": DetokenizerOptions,
    "scheduler": SchedulerOptions,
    "tokenizer": TokenizerOptions,
    "gateway": GatewayOptions,
}


@dataclass(frozen=True)
class PassThrough:
    """An option the launcher has because services have it (``Option.launch``), and those services."""

    placed: Placed
    services: tuple[str, ...]

    @property
    def option(self) -> Option:
        return self.placed.option


def pass_through() -> list[PassThrough]:
    """Every ``launch`` option of the services, once per flag, with the services that take it.

    Raises:
        TypeError: two services declare one flag as different options (they must share
            one ``Option``, as ``common`` does).
    """
    found: dict[str, tuple[Placed, list[str]]] = {}
    for service, cls in SERVICES.items():
        for placed in options(cls):
            if not placed.option.launch:
                continue
            first = found.setdefault(placed.option.flag, (placed, []))
            if first[0].option is not placed.option or first[0].kind is not placed.kind:
                raise TypeError(f"{placed.option.flag}: {service} and {first[1]} declare different options")
            first[1].append(service)
    return [PassThrough(placed, tuple(services)) for placed, services in found.values()]
