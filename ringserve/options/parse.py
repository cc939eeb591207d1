"""argparse from the option table, and the frozen config built from what it parsed.

``ConfigParser(SchedulerConfig, ...)`` walks the config dataclass (and the dataclasses
nested in it, such as ``engine: EngineConfig``), adds one argument per option field and
the flags of each group field, parses, applies each option's check, and builds the config
with every option's value in its field: nothing is restated per flag. An argument's dest
is the field's path from the top config ("engine.dtype").
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from ringserve.options.spec import GROUP, OPTION, REQUIRED, Group, Option


@dataclass(frozen=True)
class Placed:
    """An option where a config holds it: ``dest`` is the field's path ("engine.dtype"),
    ``kind`` the value's type without None (int, float, str, Path, bool, or tuple for a
    repeated flag)."""

    dest: str
    option: Option
    kind: type


def _metadata(cls: type, name: str) -> Mapping[str, Any]:
    """The option metadata of field ``name``: a subclass that redeclares the field (to give
    it a default factory, or a subclass type) keeps the option its base declared."""
    for klass in cls.__mro__:
        declared: dict[str, dataclasses.Field[Any]] = getattr(klass, "__dataclass_fields__", {})
        found = declared.get(name)
        if found is not None and (OPTION in found.metadata or GROUP in found.metadata):
            return found.metadata
    return {}


def _kind(hint: Any) -> type:
    """int for ``int | None``, tuple for ``tuple[str, ...]``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    kind: type = typing.get_origin(hint) or hint
    return kind


def _nested(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def walk(cls: type, prefix: str = "") -> Iterator[tuple[str, Placed | Group]]:
    """(dest, option or group) of every field of ``cls`` and of the dataclasses nested in it,
    in field order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta, dest = _metadata(cls, f.name), prefix + f.name
        if OPTION in meta:
            yield dest, Placed(dest, meta[OPTION], _kind(hints[f.name]))
        elif GROUP in meta:
            yield dest, meta[GROUP]
        elif _nested(hints[f.name]):
            yield from walk(hints[f.name], dest + ".")


def options(cls: type) -> list[Placed]:
    """Every option of ``cls`` (nested ones included), in field order."""
    return [p for _, p in walk(cls) if isinstance(p, Placed)]


def help_text(opt: Option, prefix: str = "") -> str:
    """The option's help, with its default appended unless the help already says it."""
    default = opt.default
    shown = not (default is None or default is False or default == () or default is REQUIRED) \
        and "default" not in opt.help
    return prefix + opt.help + (f" (default {default})" if shown else "")


def add_option(parser: argparse.ArgumentParser, mutexes: dict[str, Any], placed: Placed, dest: str | None = None,
               help_prefix: str = "") -> None:
    """Add ``placed``'s argument(s) to ``parser``; ``mutexes`` holds the parser's mutually
    exclusive groups by ``Option.mutex``."""
    opt, kind, dest = placed.option, placed.kind, dest or placed.dest
    target: Any = parser
    if opt.mutex:
        if opt.mutex not in mutexes:
            mutexes[opt.mutex] = parser.add_mutually_exclusive_group()
        target = mutexes[opt.mutex]
    help_ = help_text(opt, help_prefix)
    if opt.negative is not None:
        pair = parser.add_mutually_exclusive_group()
        pair.add_argument(opt.flag, dest=dest, action="store_const", const=True, default=opt.default, help=help_)
        pair.add_argument(opt.negative, dest=dest, action="store_const", const=False,
                          help=help_prefix + (opt.negative_help or ""))
    elif opt.const is not None:
        target.add_argument(opt.flag, dest=dest, action="store_const", const=opt.const, default=opt.default,
                            help=help_)
    elif kind is bool:
        target.add_argument(opt.flag, dest=dest, action="store_true", help=help_)
    else:
        # The flag's name, not the dest, in usage lines; choices show themselves.
        metavar = opt.metavar or (None if opt.choices else opt.flag.lstrip("-").replace("-", "_").upper())
        if kind is tuple:
            target.add_argument(opt.flag, dest=dest, action="append", default=[], metavar=metavar, help=help_)
            return
        where: dict[str, Any] = {"required": True} if opt.default is REQUIRED else {"default": opt.default}
        target.add_argument(opt.flag, dest=dest, type=kind if kind is not str else None, choices=opt.choices,
                            metavar=metavar, help=help_, **where)


def check(parser: argparse.ArgumentParser, values: Mapping[str, Any], placed: list[Placed],
          dests: Mapping[str, str] | None = None) -> None:
    """Apply each option's check to its parsed value; the first failure is a parser error
    (exit status 2). ``dests``: a dest other than ``Placed.dest`` per flag."""
    for p in placed:
        if p.option.check is not None:
            error = p.option.check(p.option.flag, values[(dests or {}).get(p.option.flag, p.dest)])
            if error:
                parser.error(error)


def build(cls: type, parser: argparse.ArgumentParser, args: argparse.Namespace, values: Mapping[str, Any],
          prefix: str = "") -> Any:
    """``cls`` with every option field set from ``values`` (dest -> value), every group field
    built from ``args``, nested configs built the same way; other fields keep their defaults.

    A None for a field whose config gives it a default factory takes the factory's value
    (the tokenizer's instance id, its worker count).
    """
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        meta, dest = _metadata(cls, f.name), prefix + f.name
        if OPTION in meta:
            value = values[dest]
            if value is None and f.default_factory is not dataclasses.MISSING:
                continue
            value = tuple(value) if isinstance(value, list) else value
            kwargs[f.name] = meta[OPTION].convert(value) if meta[OPTION].convert else value
        elif GROUP in meta:
            kwargs[f.name] = meta[GROUP].build(parser, args)
        elif _nested(hints[f.name]) and options(hints[f.name]):
            kwargs[f.name] = build(hints[f.name], parser, args, values, dest + ".")
    return cls(**kwargs)


def add_config(parser: argparse.ArgumentParser, cls: type) -> dict[str, Any]:
    """Add the argument(s) of every option and group of ``cls`` (nested configs included);
    return the mutually exclusive groups made, by ``Option.mutex``."""
    mutexes: dict[str, Any] = {}
    for _, item in walk(cls):
        if isinstance(item, Placed):
            add_option(parser, mutexes, item)
        else:
            item.add(parser)
    return mutexes


class ConfigParser:
    """The command line of one config dataclass: its parser, checks and builder.

    Args:
        cls: the config (a subclass of a table's option dataclass).
        prog, description: for ``--help``.
    """

    def __init__(self, cls: type, prog: str, description: str | None = None):
        self.cls = cls
        self.parser = argparse.ArgumentParser(prog=prog, description=description)
        self.placed = options(cls)
        add_config(self.parser, cls)

    def parse(self, argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, Any]]:
        """Parse and check ``argv``: the namespace (for groups) and its values by dest.
        A bad value exits with status 2 and the parser's message."""
        args = self.parser.parse_args(argv)
        values = vars(args).copy()
        check(self.parser, values, self.placed)
        return args, values

    def error(self, message: str) -> NoReturn:
        """Exit with status 2 and ``message``, as argparse does for a bad flag."""
        self.parser.error(message)

    def build(self, args: argparse.Namespace, values: Mapping[str, Any]) -> Any:
        """The config from ``parse``'s results (``values`` possibly amended, e.g. a resolved model)."""
        return build(self.cls, self.parser, args, values)
