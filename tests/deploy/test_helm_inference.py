"""The chart's Kubernetes inference surface: the InferencePool (a whole ring per replica pod,
its gateway the pool's endpoint) and the model replicas scaled on load by an HPA through
prometheus-adapter or by a KEDA ScaledObject. Rendered, linted and validated offline, the
custom resources against their vendored CRD schemas (tests/helpers/crds.py)."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from ringserve.options.parse import ConfigParser
from ringserve.options.table import SERVICES
from tests.helpers.crds import crd_schemas, validate_custom, validate_rendered
from tests.helpers.helm import CHART, FULL, NAMESPACE, POOL_SETS, RELEASE, VALUES, by, container, lint, render
from tests.helpers.repo import REPO

DOCUMENTED = set(re.findall(r"^\| `(ringserve:[a-z_]+)`", (REPO / "docs" / "metrics.md").read_text(), re.M))


@pytest.fixture(scope="module")
def rendered(helm: Path) -> dict[str, list[dict]]:
    return {name: render(helm, name) for name in POOL_SETS}


def replica_pod(docs: list[dict]) -> dict:
    return by(docs, "StatefulSet", f"{FULL}-replica")["spec"]["template"]


@pytest.mark.parametrize("values", POOL_SETS)
def test_lint_and_validate(helm: Path, rendered: dict[str, list[dict]], values: str) -> None:
    lint(helm, values)
    custom = validate_rendered(rendered[values])
    assert custom == ({"InferencePool"} if values == "inference-pool" else {"ScaledObject"})


def test_vendored_schemas_are_strict() -> None:
    """The offline check can fail: a misspelt field, a bad enum, a missing required list."""
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "p"},
            "spec": {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 8000}]}}
    validate_custom(pool)
    for path, value in ((("spec", "targetPort"), 8000), (("spec", "appProtocol"), "grpc"),
                        (("spec", "targetPorts"), [])):
        bad = copy.deepcopy(pool)
        bad[path[0]][path[1]] = value
        with pytest.raises(jsonschema.ValidationError):
            validate_custom(bad)
    assert set(crd_schemas()) == {("inference.networking.k8s.io/v1", "InferencePool"),
                                  ("keda.sh/v1alpha1", "ScaledObject")}


def test_inference_pool_selects_the_one_ring_pods(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["inference-pool"]
    pool = by(docs, "InferencePool", FULL)["spec"]
    template = replica_pod(docs)
    labels = template["metadata"]["labels"]
    selector = pool["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    assert selector == by(docs, "StatefulSet", f"{FULL}-replica")["spec"]["selector"]["matchLabels"]
    # No other pod the chart makes is an endpoint.
    others = [d for d in docs if d["kind"] in ("Deployment", "Pod") and d is not template]
    for doc in others:
        pod_labels = (doc["spec"]["template"]["metadata"] if doc["kind"] == "Deployment" else doc["metadata"])["labels"]
        assert not selector.items() <= pod_labels.items(), doc["metadata"]["name"]
    assert labels["llm-d.ai/engine-type"] == "vllm"
    # The endpoint: the pod's gateway, OpenAI HTTP; its readiness is the ring's (/health).
    gateway = container(template["spec"], "gateway")
    assert pool["targetPorts"] == [{"number": gateway["ports"][0]["containerPort"]}] == [{"number": 8000}]
    assert pool["appProtocol"] == "http" and gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    ref = pool["endpointPickerRef"]
    assert ref == {"kind": "Service", "name": "rs-epp", "port": {"number": 9002}, "failureMode": "FailOpen"}
    # The CRD's CEL rule, not evaluated offline: a Service reference needs its port.
    assert ref["kind"] != "Service" or "port" in ref


def test_each_replica_pod_runs_a_whole_ring(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["inference-pool"]
    spec = replica_pod(docs)["spec"]
    assert [c["name"] for c in spec["containers"]] == ["gateway", "tokenizer", "scheduler", "detokenizer"]
    sched, detok = container(spec, "scheduler"), container(spec, "detokenizer")
    ports = {p["name"]: p["containerPort"] for c in spec["containers"] for p in c["ports"]}
    assert f"--metrics-port={ports['metrics-sched']}" in sched["args"]
    gw_args, tok_args = container(spec, "gateway")["args"], container(spec, "tokenizer")["args"]
    # The gateway's /metrics appends its own scheduler's: the port the picker scrapes carries the ring's load.
    assert [a for a in gw_args if a.startswith(("--tokenizer=", "--metrics-upstream="))] == [
        f"--tokenizer=127.0.0.1:{ports['grpc']}", f"--metrics-upstream=http://127.0.0.1:{ports['metrics-sched']}/metrics"]
    assert [a for a in tok_args if a.startswith("--replica=")] == [
        f"--replica=127.0.0.1:{ports['grpc-sched']},127.0.0.1:{ports['grpc-detok']}"]
    for service, c in (("gateway", container(spec, "gateway")), ("tokenizer", container(spec, "tokenizer")),
                       ("scheduler", sched), ("detokenizer", detok)):
        known = set(ConfigParser(SERVICES[service], prog=service).parser._option_string_actions)
        assert {a.partition("=")[0] for a in c["args"]} <= known, service
    # The chat template's text, from the values into a ConfigMap, mounted where the flag points.
    text = yaml.safe_load((VALUES / "inference-pool.yaml").read_text())["config"]["tokenizer"]["chatTemplate"]
    assert by(docs, "ConfigMap", f"{FULL}-chat-template")["data"] == {"template.jinja": text}
    mount = next(m for m in container(spec, "tokenizer")["volumeMounts"] if m["name"] == "chat-template")
    assert f"--chat-template={mount['mountPath']}/template.jinja" in tok_args and mount["readOnly"]
    volume = next(v for v in spec["volumes"] if v["name"] == "chat-template")
    assert volume["configMap"] == {"name": f"{FULL}-chat-template"}
    # The separate tiers are gone; their Services select the ring pods.
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for name in ("gateway", "tokenizer"):
        assert ("Deployment", f"{FULL}-{name}") not in kinds
        assert ("HorizontalPodAutoscaler", f"{FULL}-{name}") not in kinds
        assert ("PodDisruptionBudget", f"{FULL}-{name}") not in kinds
        assert by(docs, "Service", f"{FULL}-{name}")["spec"]["selector"]["app.kubernetes.io/component"] == "replica"
    # The scheduler's families are scraped once, through the gateway.
    monitor = by(docs, "ServiceMonitor", f"{FULL}-replica")["spec"]["endpoints"]
    assert [e["port"] for e in monitor] == ["metrics-detok"]
    # The gateway's NetworkPolicy admits the picker's traffic to the ring pods.
    policy = by(docs, "NetworkPolicy", f"{FULL}-gateway")["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "replica"
    assert policy["ingress"][0]["ports"][0]["port"] == 8000


def test_hpa_scales_the_replicas_on_queue_depth_and_kv_usage(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["inference-pool"]
    hpa = by(docs, "HorizontalPodAutoscaler", f"{FULL}-replica")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": f"{FULL}-replica"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 6)
    assert "replicas" not in by(docs, "StatefulSet", f"{FULL}-replica")["spec"]  # the HPA owns it
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"] for m in hpa["metrics"]}
    assert targets == {"ringserve_num_requests_waiting": {"type": "AverageValue", "averageValue": "3"},
                       "ringserve_kv_cache_usage_perc": {"type": "AverageValue", "averageValue": "0.75"}}
    assert hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    # prometheus-adapter's rules turn exactly the scheduler's families into those metric names.
    rules = yaml.safe_load(by(docs, "ConfigMap", f"{FULL}-prometheus-adapter")["data"]["config.yaml"])["rules"]
    served = {}
    for rule in rules:
        series = re.fullmatch(r"(ringserve:[a-z_]+)\{namespace!=\"\",pod!=\"\"\}", rule["seriesQuery"]).group(1)
        assert series in DOCUMENTED
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        name = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
        served[name] = series
    assert served == {"ringserve_num_requests_waiting": "ringserve:num_requests_waiting",
                      "ringserve_kv_cache_usage_perc": "ringserve:kv_cache_usage_perc"}


def test_keda_scaled_object(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["keda"]
    so = by(docs, "ScaledObject", f"{FULL}-replica")["spec"]
    assert so["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": f"{FULL}-replica"}
    assert (so["minReplicaCount"], so["maxReplicaCount"], so["pollingInterval"]) == (1, 3, 10)
    behavior = so["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"] == {"stabilizationWindowSeconds": 120}
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler" and d["metadata"]["name"].endswith("replica")]
    assert "replicas" not in by(docs, "StatefulSet", f"{FULL}-replica")["spec"]
    triggers = {t["name"]: t for t in so["triggers"]}
    assert set(triggers) == {"queue-depth", "kv-cache-usage"}
    for name, family, threshold in (("queue-depth", "ringserve:num_requests_waiting", "4"),
                                    ("kv-cache-usage", "ringserve:kv_cache_usage_perc", "0.8")):
        t = triggers[name]
        assert (t["type"], t["metricType"]) == ("prometheus", "AverageValue")
        meta = t["metadata"]
        assert meta["serverAddress"] == "http://prometheus.monitoring.svc:9090" and meta["threshold"] == threshold
        m = re.fullmatch(r'sum\((ringserve:[a-z_]+)\{namespace="([^"]+)",pod=~"([^"]+)"\}\)', meta["query"])
        assert m and m.group(1) == family and family in DOCUMENTED and m.group(2) == NAMESPACE
        pods = re.compile(m.group(3))
        assert pods.fullmatch(f"{FULL}-replica-0") and pods.fullmatch(f"{FULL}-replica-12")
        assert not pods.fullmatch(f"{FULL}-tokenizer-5d9f-x2") and not pods.fullmatch(f"{FULL}-replica-0-x")
    # Without the pool, the tokenizer knows every pod name the autoscaler may create.
    tok = container(by(docs, "Deployment", f"{FULL}-tokenizer")["spec"]["template"]["spec"], "tokenizer")
    assert len([a for a in tok["args"] if a.startswith("--replica=")]) == 3


@pytest.mark.parametrize("setting", ["replica.autoscaling.mode=vpa", "replica.autoscaling.targetKvCacheUsage=1.5",
                                     "inferencePool.endpointPicker.failureMode=Retry", "inferencePool.engineType=trt"])
def test_schema_rejects_bad_values(helm: Path, setting: str) -> None:
    out = subprocess.run([str(helm), "template", RELEASE, str(CHART), "--set", setting],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and setting.split("=")[0].rsplit(".", 1)[1] in out.stderr, out.stderr
