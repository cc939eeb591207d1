"""The Helm chart against the option table (ringserve/options): every option of the four
services has its value in values.yaml, or says why not (``Option.not_in_chart``), and every
flag of a flag group (TLS, API keys, internal credential, gRPC transport) has its entry in
``GROUP_FLAGS``. For each value: the schema's type and choices are the option's, the chart's
default renders the service's own default (or no flag), a value set in a values file reaches
the container as that flag, and every flag the chart renders is one its service has. A
reason that says the chart sets the flag itself is checked too: some value set renders it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from ringserve.options.common import BY_CHART
from ringserve.options.parse import ConfigParser, Placed, options
from ringserve.options.table import SERVICES
from tests.helpers.helm import CHART, DISAGG_SETS, FULL, POOL_SETS, VALUE_SETS, by, container, render

# Where each service runs: (workload kind, name, container).
CONTAINERS = {
    "scheduler": ("StatefulSet", f"{FULL}-replica", "scheduler"),
    "detokenizer": ("StatefulSet", f"{FULL}-replica", "detokenizer"),
    "tokenizer": ("Deployment", f"{FULL}-tokenizer", "tokenizer"),
    "gateway": ("Deployment", f"{FULL}-gateway", "gateway"),
}
# Under inferencePool.enabled the gateway and the tokenizer run in the replica pods.
POOL_CONTAINERS = CONTAINERS | {"tokenizer": ("StatefulSet", f"{FULL}-replica", "tokenizer"),
                                "gateway": ("StatefulSet", f"{FULL}-replica", "gateway")}
RENDERS = [None, *VALUE_SETS, *POOL_SETS, *DISAGG_SETS]
# Under disaggregation.enabled the scheduler and the detokenizer run in two sets of pods.
DISAGG_REPLICA_SETS = ("prefill", "decode")
# The flags of the flag groups (ringserve.options.common: Group), which the option table does
# not describe one by one: where the chart sets each, or why it does not. "values: X" entries
# must render in some value set.
TLS = "values: grpcTls.enabled + grpcTls.existingSecret (mounted at /etc/ringserve/grpc-tls)"
API_KEY = "never on a command line: RINGSERVE_API_KEY from the apiKey Secret (apiKey.*)"
INTERNAL = "never on a command line: RINGSERVE_INTERNAL_TOKEN from the internalAuth Secret"
GRPC_MESSAGE = "a tuning knob: config.<service>.extraArgs passes it"
COMMON_GROUP_FLAGS = {"--tls-cert-file": TLS, "--tls-key-file": TLS, "--tls-ca-file": TLS,
                      "--grpc-max-message-bytes": GRPC_MESSAGE}
RING_GROUP_FLAGS = {"--internal-token-file": INTERNAL, "--insecure-skip-internal-auth": "values: internalAuth.enabled"}
GROUP_FLAGS = {
    "detokenizer": COMMON_GROUP_FLAGS | RING_GROUP_FLAGS,
    "scheduler": COMMON_GROUP_FLAGS | RING_GROUP_FLAGS,
    "tokenizer": COMMON_GROUP_FLAGS | RING_GROUP_FLAGS | {"--api-key": API_KEY, "--api-key-file": API_KEY},
    "gateway": COMMON_GROUP_FLAGS | {"--api-key": API_KEY, "--api-key-file": API_KEY},
}

# Defaults the chart resolves before the service would: device auto -> cpu without
# replica.gpu.enabled (what the scheduler's auto picks on a node without a GPU; cuda with it).
CHART_RESOLVES = {"--device": "cpu"}
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA = json.loads((CHART / "values.schema.json").read_text())

CHARTED = [(service, p) for service, cls in SERVICES.items() for p in options(cls) if p.option.chart]


def _id(item: tuple[str, Placed]) -> str:
    return f"{item[0]}{item[1].option.flag}"


def lookup(tree: dict, path: str) -> Any:
    for key in path.split("."):
        tree = tree[key]
    return tree


def schema_of(path: str) -> dict:
    node = SCHEMA
    for key in path.split("."):
        node = node["properties"][key]
    return node


def _disaggregated(docs: list[dict]) -> bool:
    return any(d["kind"] == "StatefulSet" and d["metadata"]["name"] == f"{FULL}-prefill" for d in docs)


def service_args(docs: list[dict], service: str, replica_set: str = "prefill") -> dict[str, str]:
    """The service container's flags -> values ("" for a switch), $(VAR)s filled in from the
    ConfigMap as Kubernetes does. Under disaggregation.enabled a scheduler's or detokenizer's
    are those of ``replica_set`` (prefill or decode)."""
    pool = any(d["kind"] == "InferencePool" for d in docs)
    kind, name, cname = (POOL_CONTAINERS if pool else CONTAINERS)[service]
    if _disaggregated(docs) and name == f"{FULL}-replica":
        name = f"{FULL}-{replica_set}"
    env = by(docs, "ConfigMap", f"{FULL}-config")["data"] | {"POD_NAME": "pod-0"}
    out = {}
    for arg in container(by(docs, kind, name)["spec"]["template"]["spec"], cname)["args"]:
        flag, _, value = arg.partition("=")
        for var, text in env.items():
            value = value.replace(f"$({var})", text)
        out[flag] = value
    return out


def parsed(placed: Placed, text: str) -> Any:
    """``text`` as the service's parser reads it; a ``ValueError`` string when it would refuse it."""
    try:
        return placed.kind(text)
    except ValueError as exc:
        return f"ValueError: {exc}"


def sample(placed: Placed) -> Any:
    """A valid value for the option other than its default, as a values file holds it."""
    opt, schema = placed.option, schema_of(placed.option.chart)
    if opt.negative is not None:
        return False
    if opt.choices:
        return next(c for c in opt.choices if c != opt.default)
    if placed.kind is bool:
        return True
    if placed.kind is str:
        return "cuda:1"  # the one free-form string charted: --device
    # Above a million: Helm holds values-file numbers as floats and prints 1e+06 unless told.
    return 2_500_000 if schema.get("type") == "integer" else 2.5


def expected_words(placed: Placed, value: Any) -> dict[str, str]:
    """The flags a service gets for ``value``."""
    words = placed.option.argv(value)
    return {w: "" for w in words} if len(words) == 1 else {words[0]: words[1]}


def test_every_service_option_has_a_chart_value_or_a_reason() -> None:
    for service, cls in SERVICES.items():
        for p in options(cls):
            opt = p.option
            assert (opt.chart is None) != (opt.not_in_chart is None), (service, opt.flag)
            assert opt.chart or len(opt.not_in_chart.strip()) > 10, (service, opt.flag, "a reason, in words")


def _option_flags(service: str) -> set[str]:
    return {f for p in options(SERVICES[service]) for f in (p.option.flag, p.option.negative) if f}


def test_every_flag_outside_the_table_has_a_group_entry() -> None:
    """A flag a group adds (a new TLS or credential flag) must say where the chart sets it."""
    for service in SERVICES:
        outside = _flags(service) - _option_flags(service) - {"-h", "--help"}
        assert outside == set(GROUP_FLAGS[service]), (service, outside ^ set(GROUP_FLAGS[service]))


@pytest.fixture(scope="module")
def renders(helm: Path) -> dict[str | None, list[dict]]:
    return {values: render(helm, values) for values in RENDERS}


def _rendered_anywhere(renders: dict[str | None, list[dict]], service: str, flag: str) -> bool:
    return any(flag in service_args(docs, service, s) for docs in renders.values() for s in DISAGG_REPLICA_SETS)


def test_what_the_chart_says_it_sets_it_renders(renders: dict[str | None, list[dict]]) -> None:
    """"set by the chart" (an option's reason) and "values:" (a group flag's entry) are
    claims: some value set renders the flag for that service."""
    claimed = [(service, p.option.flag) for service, cls in SERVICES.items() for p in options(cls)
               if (p.option.not_in_chart or "").startswith(BY_CHART)]
    claimed += [(service, flag) for service, flags in GROUP_FLAGS.items()
                for flag, where in flags.items() if where.startswith("values:")]
    assert ("tokenizer", "--chat-template") in claimed and ("gateway", "--metrics-upstream") in claimed
    missing = [(service, flag) for service, flag in claimed if not _rendered_anywhere(renders, service, flag)]
    assert not missing, missing


@pytest.mark.parametrize("item", CHARTED, ids=_id)
def test_values_and_schema_take_what_the_option_takes(item: tuple[str, Placed]) -> None:
    _, placed = item
    opt = placed.option
    lookup(VALUES, opt.chart)  # present in values.yaml
    schema = schema_of(opt.chart)
    if opt.negative is not None:  # auto | true | false
        assert schema["enum"] == ["auto", True, False, "true", "false"]
    elif opt.choices:
        unset = [""] if opt.default is None else []  # "": the flag is left out
        assert schema["enum"] == unset + list(opt.choices)
    elif placed.kind is bool:
        assert schema["type"] == "boolean"
    elif placed.kind is int:
        assert schema["type"] == "integer"
    elif placed.kind is float:  # an integer-only value is still a valid float (gracePeriod: pod seconds)
        assert schema["type"] in ("number", "integer")
    else:
        assert schema["type"] == "string"


@pytest.fixture(scope="module")
def defaults(helm: Path) -> list[dict]:
    return render(helm, None)


@pytest.mark.parametrize("item", CHARTED, ids=_id)
def test_chart_default_is_the_services_default(defaults: list[dict], item: tuple[str, Placed]) -> None:
    service, placed = item
    opt = placed.option
    args = service_args(defaults, service)
    flags = [f for f in (opt.flag, opt.negative) if f]
    given = [f for f in flags if f in args]
    if not given:
        return  # left out: the service's default
    assert given == [opt.flag] and opt.negative is None and placed.kind is not bool, (service, given)
    assert parsed(placed, args[opt.flag]) == CHART_RESOLVES.get(opt.flag, opt.default)  # "5" is 5.0


def _sampled(helm: Path, tmp_path_factory: pytest.TempPathFactory, disaggregated: bool) -> list[dict]:
    """The chart rendered with every charted option set to its sample, from a values file."""
    values: dict = {"disaggregation": {"enabled": True}} if disaggregated else {}
    for _, placed in CHARTED:
        *parents, leaf = placed.option.chart.split(".")
        node = values
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = sample(placed)
    path = tmp_path_factory.mktemp("values") / "sampled.yaml"
    path.write_text(yaml.safe_dump(values))
    return render(helm, None, "-f", str(path))


@pytest.fixture(scope="module")
def sampled(helm: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _sampled(helm, tmp_path_factory, disaggregated=False)


@pytest.fixture(scope="module")
def sampled_disaggregated(helm: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The same with disaggregation.enabled: every value reaches both the prefill and the decode set."""
    return _sampled(helm, tmp_path_factory, disaggregated=True)


@pytest.mark.parametrize("item", CHARTED, ids=_id)
def test_a_chart_value_reaches_the_services_flag(sampled: list[dict], sampled_disaggregated: list[dict],
                                                  item: tuple[str, Placed]) -> None:
    service, placed = item
    value = sample(placed)
    # disaggregation.* values are for the prefill and decode sets only.
    cases = [(sampled_disaggregated, s) for s in DISAGG_REPLICA_SETS]
    if not placed.option.chart.startswith("disaggregation."):
        cases.append((sampled, "prefill"))
    for docs, replica_set in cases:
        args = service_args(docs, service, replica_set)
        for flag, word in expected_words(placed, value).items():
            assert flag in args, (service, replica_set, flag)
            assert args[flag] == word or parsed(placed, args[flag]) == placed.kind(word), (service, flag, args[flag])


def _flags(service: str) -> set[str]:
    return set(ConfigParser(SERVICES[service], prog=service).parser._option_string_actions)


@pytest.mark.parametrize("values", RENDERS)
def test_every_rendered_flag_is_one_its_service_has(renders: dict[str | None, list[dict]], values: str | None) -> None:
    docs = renders[values]
    for service in CONTAINERS:
        for replica_set in DISAGG_REPLICA_SETS:
            unknown = set(service_args(docs, service, replica_set)) - _flags(service)
            assert not unknown, (values, service, replica_set, unknown)


def test_every_sampled_flag_is_one_its_service_has(sampled: list[dict], sampled_disaggregated: list[dict]) -> None:
    for service in CONTAINERS:
        for docs in (sampled, sampled_disaggregated):
            for replica_set in DISAGG_REPLICA_SETS:
                assert set(service_args(docs, service, replica_set)) <= _flags(service), service
