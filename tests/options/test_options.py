"""The option table (ringserve/options): each option parses back from the words that pass it
on, the launcher passes exactly the options given to exactly the services that have them and
refuses what they would refuse, and docs/flags.md is what the table renders."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from ringserve.launch import parse_args as launch_args
from ringserve.options import names
from ringserve.options.parse import ConfigParser, Placed, options
from ringserve.options.reference import markdown
from ringserve.options.spec import REQUIRED, option
from ringserve.options.table import SERVICES, pass_through

REPO = Path(__file__).resolve().parents[2]
# What each service needs besides the option under test to parse at all.
REQUIRED_ARGS = {"gateway": [], "tokenizer": ["--model", "m", "--insecure-skip-internal-auth"],
                 "scheduler": ["--model", "m", "--insecure-skip-internal-auth"],
                 "detokenizer": ["--model", "m", "--insecure-skip-internal-auth"]}


def sample(placed: Placed, tmp_path: Path) -> Any:
    """A value the option accepts other than its default."""
    opt = placed.option
    if opt.negative is not None:
        return False
    if opt.const is not None:
        return opt.const
    if opt.choices:
        return next(c for c in opt.choices if c != opt.default)
    if placed.kind is bool:
        return True
    if placed.kind is tuple:
        return ("127.0.0.1:1,127.0.0.1:2", "127.0.0.1:3,127.0.0.1:4")
    if placed.kind is Path:
        path = tmp_path / "file"
        path.write_text("{{ messages }}")
        return path
    if opt.flag == "--device":
        return "cuda:1"
    if placed.kind is str:
        return "10.0.0.1:1" if ":" in str(opt.default) or opt.flag == "--dist-init-addr" else "name"
    return {int: 3, float: 0.5}[placed.kind]


def field_value(config: Any, dest: str) -> Any:
    for name in dest.split("."):
        config = getattr(config, name)
    return config


def parse_as(service: str, argv: list[str]) -> Any:
    cli = ConfigParser(SERVICES[service], prog=service)
    return cli.build(*cli.parse(REQUIRED_ARGS[service] + argv))


def test_every_option_parses_back_from_the_words_that_pass_it_on(tmp_path: Path) -> None:
    """``Option.argv`` (the launcher's pass-through) is what the service's parser reads."""
    seen = 0
    for service, cls in SERVICES.items():
        for placed in options(cls):
            if placed.option.default is REQUIRED:
                continue
            value = sample(placed, tmp_path)
            config = parse_as(service, placed.option.argv(value))
            convert = placed.option.convert or (lambda v: v)
            assert field_value(config, placed.dest) == convert(value), (service, placed.option.flag)
            seen += 1
    assert seen == 100  # every option with a default, over the four services


def test_the_launcher_passes_each_option_given_to_the_services_that_have_it(tmp_path: Path) -> None:
    passed = pass_through()
    assert len(passed) == 43
    for item in passed:
        value = sample(item.placed, tmp_path)
        config = launch_args(["--model", "m", *item.option.argv(value)])
        for service in SERVICES:
            if service not in item.services:
                assert config.passed(service) == (), (item.option.flag, service)
                continue
            dest = {p.option.flag: p.dest for p in options(SERVICES[service])}[item.option.flag]
            got = field_value(parse_as(service, list(config.passed(service))), dest)
            assert got == (item.option.convert or (lambda v: v))(value), (item.option.flag, service)


def test_shared_options_go_to_every_service_that_has_them() -> None:
    config = launch_args(["--model", "m", "--context-length", "512", "--served-model-name", "m2"])
    assert config.passed("scheduler") == config.passed("tokenizer") == (
        "--served-model-name", "m2", "--context-length", "512")
    assert config.passed("detokenizer") == ("--served-model-name", "m2")
    assert config.passed("gateway") == ()


def test_defaults_pass_nothing_on() -> None:
    config = launch_args(["--model", "m", "--dtype", "auto", "--grammar-backend", "llguidance"])
    assert dict(config.forward) == {service: () for service in SERVICES}
    assert config.kv_cache_mem_fraction == 0.3


def test_a_kv_pool_size_replaces_the_memory_share() -> None:
    assert launch_args(["--model", "m", "--kv-cache-gib", "1.5"]).kv_cache_mem_fraction is None
    assert launch_args(["--model", "m", "--max-total-tokens", "4096"]).kv_cache_mem_fraction is None


@pytest.mark.parametrize("argv, message", [
    (["--max-queued-tokens", "0"], "--max-queued-tokens must be > 0"),
    (["--max-queued-requests", "-1"], "--max-queued-requests must be >= 0"),
    (["--max-running-requests", "0"], "--max-running-requests must be >= 1"),
    (["--kv-cache-mem-fraction", "1"], "--kv-cache-mem-fraction must be in (0, 1)"),
    (["--tokenizers", "0"], "--tokenizers must be >= 1"),
    (["--device", "tpu"], "--device 'tpu': use auto, cpu, cuda or cuda:N"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template /no/such/template.jinja: no such file"),
    (["--max-total-tokens", "8", "--kv-cache-gib", "1"],
     "argument --kv-cache-gib: not allowed with argument --max-total-tokens"),
    (["--tool-call-parser", "json"], "argument --tool-call-parser: invalid choice: 'json'"),
])
def test_the_launcher_refuses_what_the_service_would(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        launch_args(["--model", "m", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_nested_config_and_default_factories_are_built() -> None:
    from services.tokenizer.main import TokenizerConfig
    from services.tokenizer.readiness import ReadinessConfig
    from services.tokenizer.workers import default_workers

    cli = ConfigParser(TokenizerConfig, prog="tokenizer")
    config = cli.build(*cli.parse(REQUIRED_ARGS["tokenizer"] + ["--readiness-stall-timeout", "9"]))
    assert config.readiness == ReadinessConfig(stall_s=9.0) and type(config.readiness) is ReadinessConfig
    assert config.instance_id.startswith("tok-") and config.tokenize_workers == default_workers()


def test_one_flag_declared_twice_differently_is_refused(monkeypatch) -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Other:
        context_length: int | None = option("--context-length", None, launch=True, help="a different option")

    monkeypatch.setitem(SERVICES, "other", Other)
    with pytest.raises(TypeError, match="--context-length: other and"):
        pass_through()


def test_a_registry_that_differs_from_its_names_fails_naming_both_sides() -> None:
    with pytest.raises(RuntimeError, match=r"^tool-call parser registry and its option's choices differ: no "
                                           r"implementation of missing; extra not named in ringserve.options.names$"):
        names.check_registry("tool-call parser", {"hermes": 1, "extra": 2}, ("hermes", "missing"))
    names.check_registry("tool-call parser", {"hermes": 1}, ("hermes",))


def test_flag_reference_is_current() -> None:
    """docs/flags.md is regenerated with ``python -m ringserve.options --markdown > docs/flags.md``."""
    assert (REPO / "docs" / "flags.md").read_text() == markdown()
