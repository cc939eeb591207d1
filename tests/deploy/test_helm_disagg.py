"""The chart's prefill/decode disaggregation (disaggregation.enabled): a prefill and a decode
replica StatefulSet instead of the replica one, each with its own size, resources, placement and
autoscaler, the tokenizer's --replica entries for both sets' pods, the handoff's NetworkPolicy,
and the refusal of inferencePool.enabled. Rendered, linted and validated offline (kubernetes-validate,
the custom resources against their vendored CRDs)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers.crds import validate_rendered
from tests.helpers.helm import CHART, DISAGG_SETS, FULL, NAMESPACE, RELEASE, VALUES, by, container, lint, render

MODE_LABEL = "ringserve.io/disaggregation-mode"
SETS = ("prefill", "decode")


@pytest.fixture(scope="module")
def rendered(helm: Path) -> dict[str, list[dict]]:
    docs = {name: render(helm, name) for name in DISAGG_SETS}
    docs["defaults"] = render(helm, None)
    # Fixed sizes (no autoscaler), and the replica set's own values left as they are.
    docs["fixed"] = render(helm, None, "--set", "disaggregation.enabled=true",
                           "--set", "disaggregation.prefill.replicas=2", "--set", "disaggregation.decode.replicas=3")
    docs["grpc"] = render(helm, None, "--set", "disaggregation.enabled=true",
                          "--set", "disaggregation.transferBackend=grpc")
    return docs


def pod_spec(docs: list[dict], name: str) -> dict:
    return by(docs, "StatefulSet", name)["spec"]["template"]["spec"]


def host(replica_set: str, i: int) -> str:
    return f"{FULL}-{replica_set}-{i}.{FULL}-{replica_set}.{NAMESPACE}.svc.cluster.local"


def tokenizer_replicas(docs: list[dict]) -> list[str]:
    tok = container(by(docs, "Deployment", f"{FULL}-tokenizer")["spec"]["template"]["spec"], "tokenizer")
    return [a.removeprefix("--replica=") for a in tok["args"] if a.startswith("--replica=")]


@pytest.mark.parametrize("values", DISAGG_SETS)
def test_lint_and_validate(helm: Path, rendered: dict[str, list[dict]], values: str) -> None:
    lint(helm, values)
    assert validate_rendered(rendered[values]) == (set() if values == "disaggregated" else {"ScaledObject"})


def test_two_sets_replace_the_replica_set(rendered: dict[str, list[dict]]) -> None:
    for values in (*DISAGG_SETS, "fixed"):
        docs = rendered[values]
        sets = sorted(d["metadata"]["name"] for d in docs if d["kind"] == "StatefulSet")
        assert sets == [f"{FULL}-decode", f"{FULL}-prefill"], values
        services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
        assert services == {f"{FULL}-gateway", f"{FULL}-tokenizer", f"{FULL}-prefill", f"{FULL}-decode"}
    defaults = rendered["defaults"]
    assert [d["metadata"]["name"] for d in defaults if d["kind"] == "StatefulSet"] == [f"{FULL}-replica"]
    assert MODE_LABEL not in yaml.safe_dump_all(defaults)


def test_each_set_selects_its_own_pods(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["fixed"]
    for replica_set in SETS:
        name = f"{FULL}-{replica_set}"
        selector = {"app.kubernetes.io/name": "ringserve", "app.kubernetes.io/instance": RELEASE,
                    "app.kubernetes.io/component": "replica", MODE_LABEL: replica_set}
        sts = by(docs, "StatefulSet", name)
        assert sts["spec"]["serviceName"] == name
        assert sts["spec"]["selector"]["matchLabels"] == selector
        # The chart's ReadWriteOnce model claim: every model pod on one node.
        pod_labels = selector | {"ringserve.io/model-volume": f"{FULL}-models"}
        assert sts["spec"]["template"]["metadata"]["labels"] == pod_labels
        svc = by(docs, "Service", name)
        assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == selector
        assert svc["metadata"]["labels"]["app.kubernetes.io/component"] == "replica"  # the replica ServiceMonitor's
    assert by(docs, "StatefulSet", f"{FULL}-prefill")["spec"]["replicas"] == 2
    assert by(docs, "StatefulSet", f"{FULL}-decode")["spec"]["replicas"] == 3


def test_each_set_runs_the_replica_pod_with_its_mode(rendered: dict[str, list[dict]]) -> None:
    """The replica pod's scheduler and detokenizer, the scheduler with its mode and the handoff timeout."""
    replica = pod_spec(rendered["defaults"], f"{FULL}-replica")
    for values, timeout in (("fixed", "30"), ("disaggregated", "45")):
        for replica_set in SETS:
            spec = pod_spec(rendered[values], f"{FULL}-{replica_set}")
            assert [c["name"] for c in spec["containers"]] == ["scheduler", "detokenizer"]
            assert [c["name"] for c in spec["initContainers"]] == ["prepare-model"]
            args = container(spec, "scheduler")["args"]
            added = [f"--disaggregation-mode={replica_set}", f"--disaggregation-transfer-timeout={timeout}",
                     "--disaggregation-transfer-backend=mooncake"]
            i = args.index(added[0])
            assert args[i:i + 3] == added
            assert args[:i] + args[i + 3:] == container(replica, "scheduler")["args"]
            assert container(spec, "detokenizer")["args"] == container(replica, "detokenizer")["args"]
            if values == "fixed":  # nothing of the set's own: the replica set's resources and placement
                assert container(spec, "scheduler")["resources"] == container(replica, "scheduler")["resources"]
                assert "nodeSelector" not in spec and "tolerations" not in spec


def test_each_set_has_its_own_resources_and_placement(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["disaggregated"]
    replica_resources = container(pod_spec(rendered["defaults"], f"{FULL}-replica"), "scheduler")["resources"]
    prefill, decode = pod_spec(docs, f"{FULL}-prefill"), pod_spec(docs, f"{FULL}-decode")
    assert container(prefill, "scheduler")["resources"] == {"requests": {"cpu": "8", "memory": "16Gi"},
                                                           "limits": {"cpu": "8", "memory": "16Gi"}}
    assert container(decode, "scheduler")["resources"] == replica_resources
    assert prefill["nodeSelector"] == {"ringserve.io/pool": "prefill"}
    assert prefill["tolerations"] == [{"key": "ringserve.io/prefill", "operator": "Exists", "effect": "NoSchedule"}]
    assert decode["nodeSelector"] == {"ringserve.io/pool": "decode"} and "tolerations" not in decode
    # A ReadWriteMany model claim: no affinity ties the two sets' pods to one node.
    assert "affinity" not in prefill and "affinity" not in decode
    # The init container asks for what its set's scheduler asks for.
    assert prefill["initContainers"][0]["resources"] == container(prefill, "scheduler")["resources"]


def test_the_tokenizer_has_both_sets_pods(rendered: dict[str, list[dict]]) -> None:
    def entries(replica_set: str, n: int) -> list[str]:
        return [f"{host(replica_set, i)}:30020,{host(replica_set, i)}:30030" for i in range(n)]

    assert tokenizer_replicas(rendered["fixed"]) == entries("prefill", 2) + entries("decode", 3)
    # Under an autoscaler, every pod name up to each set's maxReplicas.
    assert tokenizer_replicas(rendered["disaggregated"]) == entries("prefill", 3) + entries("decode", 6)
    assert tokenizer_replicas(rendered["disaggregated-keda"]) == entries("prefill", 2) + entries("decode", 2)


def test_hpa_per_set(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["disaggregated"]
    hpas = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "HorizontalPodAutoscaler"}
    assert set(hpas) == {f"{FULL}-gateway", f"{FULL}-prefill", f"{FULL}-decode"}  # the gateway's on CPU
    expected = {"prefill": (3, {"ringserve_num_requests_waiting": "2", "ringserve_num_prompt_tokens_waiting": "4096"}),
                "decode": (6, {"ringserve_num_requests_running": "24", "ringserve_kv_cache_usage_perc": "0.7"})}
    for replica_set, (most, targets) in expected.items():
        name = f"{FULL}-{replica_set}"
        hpa = hpas[name]
        assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name}
        assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, most)
        assert {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["metrics"]} == \
            {metric: {"type": "AverageValue", "averageValue": v} for metric, v in targets.items()}
        assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 120
        assert "replicas" not in by(docs, "StatefulSet", name)["spec"]  # the HPA owns it
    rules = yaml.safe_load(by(docs, "ConfigMap", f"{FULL}-prometheus-adapter")["data"]["config.yaml"])["rules"]
    families = ("num_requests_waiting", "num_prompt_tokens_waiting", "num_requests_running", "kv_cache_usage_perc")
    assert [r["seriesQuery"] for r in rules] == [f'ringserve:{m}{{namespace!="",pod!=""}}' for m in families]


def test_keda_per_set(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["disaggregated-keda"]
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("prometheus-adapter")]
    expected = {"prefill": {"queue-depth": ("ringserve:num_requests_waiting", "3"),
                            "waiting-prompt-tokens": ("ringserve:num_prompt_tokens_waiting", "8192")},
                "decode": {"running-requests": ("ringserve:num_requests_running", "16"),
                           "kv-cache-usage": ("ringserve:kv_cache_usage_perc", "0.8")}}
    objects = {d["metadata"]["name"] for d in docs if d["kind"] == "ScaledObject"}
    assert objects == {f"{FULL}-prefill", f"{FULL}-decode"}
    for replica_set, triggers in expected.items():
        name = f"{FULL}-{replica_set}"
        so = by(docs, "ScaledObject", name)["spec"]
        assert so["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name}
        assert (so["minReplicaCount"], so["maxReplicaCount"]) == (1, 2)
        got = {}
        for t in so["triggers"]:
            m = re.fullmatch(r'sum\((ringserve:[a-z_]+)\{namespace="serve",pod=~"([^"]+)"\}\)', t["metadata"]["query"])
            assert m and m.group(2) == f"{name}-[0-9]+", t
            assert t["metadata"]["serverAddress"] == "http://prometheus.monitoring.svc:9090"
            got[t["name"]] = (m.group(1), t["metadata"]["threshold"])
        assert got == triggers
        assert "replicas" not in by(docs, "StatefulSet", name)["spec"]


def test_prefill_pods_reach_the_decode_schedulers(rendered: dict[str, list[dict]]) -> None:
    """The decode scheduler's Disagg service (the tokenizer's bootstrap address: its scheduler
    port) is open to the prefill pods, on top of the replica policy (tokenizer -> both sets)."""
    docs = rendered["disaggregated"]
    base = {"app.kubernetes.io/name": "ringserve", "app.kubernetes.io/instance": RELEASE,
            "app.kubernetes.io/component": "replica"}
    policy = by(docs, "NetworkPolicy", f"{FULL}-decode")["spec"]
    assert policy["podSelector"] == {"matchLabels": base | {MODE_LABEL: "decode"}}
    # With mooncake (the default) also Mooncake's handshake and TCP data listeners, in their fixed range.
    assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": base | {MODE_LABEL: "prefill"}}}],
                                  "ports": [{"port": 30020, "protocol": "TCP"},
                                            {"port": 30100, "endPort": 30103, "protocol": "TCP"}]}]
    grpc = by(rendered["grpc"], "NetworkPolicy", f"{FULL}-decode")["spec"]
    assert grpc["ingress"][0]["ports"] == [{"port": 30020, "protocol": "TCP"}]
    replica = by(docs, "NetworkPolicy", f"{FULL}-replica")["spec"]
    assert replica["podSelector"] == {"matchLabels": base}  # both sets' pods
    assert [p["port"] for p in replica["ingress"][0]["ports"]] == [30020, 30030]
    assert not [d for d in rendered["defaults"] if d["kind"] == "NetworkPolicy"
                and d["metadata"]["name"] == f"{FULL}-decode"]


def test_mooncake_listens_in_the_range_its_policy_opens(rendered: dict[str, list[dict]]) -> None:
    """Mooncake picks its two listeners' ports at random unless MC_MIN_RPC_PORT/MC_MAX_RPC_PORT
    bound them: both sets' schedulers get the range under mooncake, nothing under grpc."""
    ports = [{"name": "MC_MIN_RPC_PORT", "value": "30100"}, {"name": "MC_MAX_RPC_PORT", "value": "30103"}]
    for values, want in (("disaggregated", ports), ("grpc", [])):
        for replica_set in SETS:
            scheduler = container(pod_spec(rendered[values], f"{FULL}-{replica_set}"), "scheduler")
            assert [e for e in scheduler["env"] if e["name"].startswith("MC_")] == want, (values, replica_set)
            backend = "grpc" if values == "grpc" else "mooncake"
            assert f"--disaggregation-transfer-backend={backend}" in scheduler["args"]
    replica = container(pod_spec(rendered["defaults"], f"{FULL}-replica"), "scheduler")
    assert not [e for e in replica["env"] if e["name"].startswith("MC_")]


def test_inference_pool_is_refused(helm: Path) -> None:
    out = subprocess.run([str(helm), "template", RELEASE, str(CHART), "-f", str(VALUES / "inference-pool.yaml"),
                          "--set", "disaggregation.enabled=true"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert ("disaggregation.enabled cannot be combined with inferencePool.enabled: under the pool each replica "
            "pod runs a whole ring whose tokenizer sends to its own scheduler only") in out.stderr, out.stderr


@pytest.mark.parametrize("setting", ["disaggregation.transferTimeout=0",
                                     "disaggregation.decode.autoscaling.targetKvCacheUsage=1.5",
                                     "disaggregation.prefill.autoscaling.targetRunningRequests=3",
                                     "disaggregation.prefill.autoscaling.mode=vpa",
                                     "disaggregation.decode.replicas=0",
                                     "disaggregation.prefill.scheduler.resources.gpus=1",
                                     "disaggregation.transferBackend=nixl",
                                     "disaggregation.mooncakePorts.max=70000"])
def test_schema_rejects_bad_values(helm: Path, setting: str) -> None:
    out = subprocess.run([str(helm), "template", RELEASE, str(CHART), "--set", setting],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and setting.split("=")[0].rsplit(".", 1)[1] in out.stderr, out.stderr


def test_a_mooncake_range_of_one_port_is_refused(helm: Path) -> None:
    out = subprocess.run([str(helm), "template", RELEASE, str(CHART), "--set", "disaggregation.enabled=true",
                          "--set", "disaggregation.mooncakePorts.max=30100"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert ("disaggregation.mooncakePorts: Mooncake's handshake and TCP data listeners need two ports at least "
            "(min < max)") in out.stderr, out.stderr
