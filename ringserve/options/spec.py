"""What one option is: its flag, help, default, choices, check, and who uses it.

An option is a field of a frozen dataclass whose metadata holds an ``Option``
(``option(...)`` makes the field); the field's name is the config attribute, its type
annotation the value's type. The services' config dataclasses subclass those option
dataclasses, so the field, its default and its flag are written once.

A ``Group`` is a field set by several flags that are read together (the gRPC transport,
API keys, the internal credential): its own module adds the flags and builds the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OPTION = "ringserve.option"  # the dataclass field metadata key
GROUP = "ringserve.option_group"


class Check:
    """A bound on a parsed value beyond its type and choices; ``None`` always passes."""

    def __call__(self, flag: str, value: Any) -> str | None:
        """The error for ``flag`` given ``value``, or None when it passes."""
        raise NotImplementedError

    def describe(self) -> str:
        """The rule, for the flag reference (``> 0``)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Above(Check):
    """value > limit."""

    limit: float

    def __call__(self, flag: str, value: Any) -> str | None:
        return None if value is None or value > self.limit else f"{flag} must be > {self.limit:g}"

    def describe(self) -> str:
        return f"> {self.limit:g}"


@dataclass(frozen=True)
class AtLeast(Check):
    """value >= limit. ``say_got``: the message names the value given."""

    limit: int
    say_got: bool = False

    def __call__(self, flag: str, value: Any) -> str | None:
        if value is None or value >= self.limit:
            return None
        if self.say_got:
            return f"{flag} must be at least {self.limit}, got {value}"
        return f"{flag} must be >= {self.limit}"

    def describe(self) -> str:
        return f">= {self.limit}"


@dataclass(frozen=True)
class Fraction(Check):
    """0 < value < 1 (``up_to_one``: 0 < value <= 1)."""

    up_to_one: bool = False

    def __call__(self, flag: str, value: Any) -> str | None:
        if value is None or 0 < value < 1 or (self.up_to_one and value == 1):
            return None
        return f"{flag} must be {self.describe()}"

    def describe(self) -> str:
        return "in (0, 1]" if self.up_to_one else "in (0, 1)"


@dataclass(frozen=True)
class Matches(Check):
    """A string that fully matches ``pattern``; ``spelling`` lists the forms in the error."""

    pattern: str
    spelling: str

    def __call__(self, flag: str, value: Any) -> str | None:
        if value is None or re.fullmatch(self.pattern, value):
            return None
        return f"{flag} {value!r}: use {self.spelling}"

    def describe(self) -> str:
        return self.spelling


@dataclass(frozen=True)
class ExistingFile(Check):
    """A path to a file that exists now."""

    def __call__(self, flag: str, value: Any) -> str | None:
        return None if value is None or Path(value).is_file() else f"{flag} {value}: no such file"

    def describe(self) -> str:
        return "an existing file"


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # an option without a default: the flag must be given


@dataclass(frozen=True)
class Option:
    """One flag (or an --enable/--disable pair) and how every user of it treats it.

    Attributes:
        flag: "--dtype". With ``negative`` it sets True and ``negative`` sets False.
        help: what it does, as ``--help`` and docs/flags.md show it (``--help`` appends the
            default unless the help speaks of it).
        default: the value when not given; ``REQUIRED``: the flag must be given.
        choices: the values allowed (names from ``ringserve.options.names``).
        check: a bound beyond type and choices, refused as a parser error.
        metavar: the value's name in ``--help``.
        negative: a second flag that sets False (the field is ``bool | None``, None: not said).
        negative_help: its help.
        const: for a ``bool | None`` field, the value a flag without argument sets (its only flag).
        mutex: options sharing this name may not be given together.
        convert: applied to the parsed value when the config is built (not to what the
            launcher passes on).
        launch: ``ringserve launch`` has this flag too and passes it to every service
            that has it, when its value differs from the default.
        chart: where the Helm chart's values.yaml sets it (``config.scheduler.dtype``).
        not_in_chart: why the chart has no value for it (set by the chart itself, or not
            for a Kubernetes deployment). A service's option has ``chart`` or this.
    """

    flag: str
    default: Any = REQUIRED
    _: dataclasses.KW_ONLY
    help: str
    choices: tuple[Any, ...] | None = None
    check: Check | None = None
    metavar: str | None = None
    negative: str | None = None
    negative_help: str | None = None
    const: Any = None
    mutex: str | None = None
    convert: Callable[[Any], Any] | None = None
    launch: bool = False
    chart: str | None = None
    not_in_chart: str | None = None

    def field(self) -> Any:
        """A dataclass field holding this option (``x: int = OPT.field()``)."""
        if self.default is REQUIRED:
            return dataclasses.field(metadata={OPTION: self})
        if isinstance(self.default, (list, dict, set)):
            raise TypeError(f"{self.flag}: a mutable default; use a tuple")
        return dataclasses.field(default=self.default, metadata={OPTION: self})

    def argv(self, value: Any) -> list[str]:
        """The command-line words that give this option ``value`` (the launcher's pass-through)."""
        if self.negative is not None:  # an --enable/--disable pair
            return [] if value is None else [self.flag if value else self.negative]
        if self.const is not None:  # a flag that sets one value
            return [self.flag] if value == self.const else []
        if isinstance(value, bool):  # a switch
            return [self.flag] if value else []
        if isinstance(value, tuple):  # repeated
            return [word for item in value for word in (self.flag, str(item))]
        return [] if value is None else [self.flag, str(value)]


def option(flag: str, default: Any = REQUIRED, *, help: str, **kwargs: Any) -> Any:  # noqa: A002 (argparse's name)
    """A dataclass field declaring the option ``flag`` (the keywords are ``Option``'s)."""
    return Option(flag, default, help=help, **kwargs).field()


@dataclass(frozen=True)
class Group:
    """A value several flags make together, with the module that owns those flags.

    Attributes:
        add: adds the flags to a parser.
        build: makes the value from the parsed flags; a bad combination is a parser error.
        default: makes the field's default.
    """

    add: Callable[[argparse.ArgumentParser], None]
    build: Callable[[argparse.ArgumentParser, argparse.Namespace], Any]
    default: Callable[[], Any]

    def field(self) -> Any:
        """A dataclass field holding this group (its default made by ``default()``)."""
        return dataclasses.field(default_factory=self.default, metadata={GROUP: self})
