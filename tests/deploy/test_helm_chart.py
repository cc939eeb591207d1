"""The Helm chart in deploy/helm/ringserve: lint, render three value sets, validate them
offline against the Kubernetes schemas (kubernetes-validate), and check the essentials."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import utils as kv_utils

from tests.helpers.helm import (
    CHART,
    FULL,
    K8S_VERSION,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    VALUES,
    by,
    container,
    render,
    render_notes,
)

# Custom resources: no upstream schema; checked structurally below.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


@pytest.fixture(scope="module")
def rendered(helm: Path) -> dict[str, list[dict]]:
    docs = {name: render(helm, name) for name in VALUE_SETS}
    docs["defaults"] = render(helm, None)
    return docs


def test_lint_strict(helm: Path) -> None:
    for values in [None, *VALUE_SETS]:
        cmd = [str(helm), "lint", "--strict", str(CHART)]
        if values:
            cmd += ["-f", str(VALUES / f"{values}.yaml")]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("values", [*VALUE_SETS, "defaults"])
def test_manifests_validate(rendered: dict[str, list[dict]], values: str) -> None:
    docs = rendered[values]
    assert docs
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in CRD_KINDS:
            # Structural check of the ServiceMonitor (no schema for CRDs offline).
            assert doc["metadata"]["name"] and doc["spec"]["endpoints"]
            assert doc["spec"]["selector"]["matchLabels"]
            continue
        kv_utils.validate(doc, K8S_VERSION, strict=True)


def test_schema_rejects_bad_values(helm: Path) -> None:
    out = subprocess.run(
        [str(helm), "template", RELEASE, str(CHART), "--set", "model.source=s3"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "source" in out.stderr


def test_cpu_single_replica(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["cpu-single"]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Ingress", f"{FULL}-gateway") not in kinds
    assert not any(d["kind"] == "ServiceMonitor" for d in docs)
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == [f"{FULL}-internal-token"]
    assert ("HorizontalPodAutoscaler", f"{FULL}-gateway") not in kinds

    cm = by(docs, "ConfigMap", f"{FULL}-config")["data"]
    assert "SCHEDULER_ADDR" not in cm and "DETOKENIZER_ADDR" not in cm
    assert cm["SCHEDULER_DETOKENIZER_ADDR"] == "127.0.0.1:30030"
    assert cm["TOKENIZER_ADDR"] == f"dns:///{FULL}-tokenizer.{NAMESPACE}.svc.cluster.local:30010"
    assert cm["MODEL_DIR"] == "/models/SmolLM2-135M-Instruct"
    assert cm["SCHEDULER_MAX_QUEUED_REQUESTS"] == "64"

    # Gateway: HTTP on 8000, /health readiness, Service port 80 -> http.
    gw_dep = by(docs, "Deployment", f"{FULL}-gateway")
    assert gw_dep["spec"]["replicas"] == 1
    gw = container(gw_dep["spec"]["template"]["spec"], "gateway")
    assert gw["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert gw["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "httpGet" in gw["livenessProbe"]
    assert "--tokenizer=$(TOKENIZER_ADDR)" in gw["args"]
    assert not any(a.startswith("--api-key") for a in gw["args"])
    svc = by(docs, "Service", f"{FULL}-gateway")
    assert svc["spec"]["ports"][0]["port"] == 80 and svc["spec"]["ports"][0]["targetPort"] == "http"

    # Tokenizer: headless Service, native grpc probes, wired to the one replica pod.
    tsvc = by(docs, "Service", f"{FULL}-tokenizer")
    assert tsvc["spec"]["clusterIP"] == "None"
    assert tsvc["spec"]["ports"][0]["port"] == 30010
    assert tsvc["spec"]["ports"][1] == {"name": "metrics", "port": 9010, "targetPort": "metrics", "protocol": "TCP"}
    tok = container(by(docs, "Deployment", f"{FULL}-tokenizer")["spec"]["template"]["spec"], "tokenizer")
    assert tok["ports"][1] == {"name": "metrics", "containerPort": 9010, "protocol": "TCP"}
    assert "--metrics-port=9010" in tok["args"]
    # Readiness follows the ring; liveness and startup the process only (a stalled replica
    # makes the tokenizer unready, never restarts it).
    assert tok["readinessProbe"]["grpc"] == {"port": 30010}
    for probe in ("livenessProbe", "startupProbe"):
        assert tok[probe]["grpc"] == {"port": 30010, "service": "liveness"}
    assert not [a for a in tok["args"] if a.startswith("--readiness-")]
    assert not [a for a in gw["args"] if a.startswith("--http-")]
    assert not [k for k in cm if k.startswith(("GATEWAY_HTTP_", "TOKENIZER_READINESS_"))]
    replica0 = f"{FULL}-replica-0.{FULL}-replica.{NAMESPACE}.svc.cluster.local"
    assert [a for a in tok["args"] if a.startswith(("--replica", "--scheduler", "--detokenizer"))] == [
        f"--replica={replica0}:30020,{replica0}:30030"]
    assert "--model=$(MODEL_DIR)" in tok["args"]

    # Replica: one pod, scheduler + detokenizer, grpc probes, startupProbe for model loading.
    sts = by(docs, "StatefulSet", f"{FULL}-replica")
    assert sts["spec"]["replicas"] == 1
    assert sts["spec"]["serviceName"] == f"{FULL}-replica"
    pod = sts["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["scheduler", "detokenizer"]
    sched, detok = container(pod, "scheduler"), container(pod, "detokenizer")
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert sched[probe]["grpc"] == {"port": 30020}
        assert detok[probe]["grpc"] == {"port": 30030}
    startup = sched["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert "--detokenizer=$(SCHEDULER_DETOKENIZER_ADDR)" in sched["args"]
    assert "--dtype=$(SCHEDULER_DTYPE)" in sched["args"] and "--device=$(SCHEDULER_DEVICE)" in sched["args"]
    assert by(docs, "ConfigMap", f"{FULL}-config")["data"]["SCHEDULER_DEVICE"] == "cpu"
    assert "--max-queued-requests=$(SCHEDULER_MAX_QUEUED_REQUESTS)" in sched["args"]
    # Metrics: one HTTP port per container (names unique in the pod), labelled with the served name.
    assert sched["ports"][1] == {"name": "metrics-sched", "containerPort": 9020, "protocol": "TCP"}
    assert detok["ports"][1] == {"name": "metrics-detok", "containerPort": 9030, "protocol": "TCP"}
    for c, port in ((sched, 9020), (detok, 9030)):
        assert f"--metrics-port={port}" in c["args"] and "--served-model-name=$(SERVED_MODEL_NAME)" in c["args"]
    assert "nvidia.com/gpu" not in sched["resources"].get("limits", {})
    assert "runtimeClassName" not in pod
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["model"]["hostPath"]["path"] == "/srv/models"
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in sched["volumeMounts"]
    rsvc = by(docs, "Service", f"{FULL}-replica")
    assert rsvc["spec"]["clusterIP"] == "None"
    assert sorted(p["port"] for p in rsvc["spec"]["ports"]) == [9020, 9030, 30020, 30030]
    assert {p["name"]: p["targetPort"] for p in rsvc["spec"]["ports"]}["metrics-detok"] == "metrics-detok"

    # Non-root everywhere.
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            assert d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_network_policy_exposes_only_gateway(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["cpu-single"]
    deny = by(docs, "NetworkPolicy", f"{FULL}-default-deny")
    assert deny["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in deny["spec"]
    gw = by(docs, "NetworkPolicy", f"{FULL}-gateway")["spec"]
    assert gw["ingress"][0]["ports"] == [{"port": 8000, "protocol": "TCP"}]
    assert "from" not in gw["ingress"][0]
    tok = by(docs, "NetworkPolicy", f"{FULL}-tokenizer")["spec"]
    assert tok["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    rep = by(docs, "NetworkPolicy", f"{FULL}-replica")["spec"]
    assert rep["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "tokenizer"
    assert sorted(p["port"] for p in rep["ingress"][0]["ports"]) == [30020, 30030]
    # Metrics ports are open to any source by default (Prometheus lives in another namespace).
    assert tok["ingress"][1] == {"ports": [{"port": 9010, "protocol": "TCP"}]}
    assert rep["ingress"][1] == {"ports": [{"port": 9020, "protocol": "TCP"}, {"port": 9030, "protocol": "TCP"}]}


def test_gpu_multi_replica(rendered: dict[str, list[dict]], helm: Path) -> None:
    docs = rendered["gpu-multi"]
    sts = by(docs, "StatefulSet", f"{FULL}-replica")
    assert sts["spec"]["replicas"] == 2
    pod = sts["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    sched = container(pod, "scheduler")
    assert sched["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert sched["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert sched["startupProbe"]["failureThreshold"] == 180
    assert "--schedule-policy=$(SCHEDULER_POLICY)" in sched["args"]
    assert "--device=$(SCHEDULER_DEVICE)" in sched["args"]
    assert by(docs, "ConfigMap", f"{FULL}-config")["data"]["SCHEDULER_DEVICE"] == "cuda"
    assert "--context-length=$(CONTEXT_LENGTH)" in sched["args"]
    assert "--watchdog-timeout=$(SCHEDULER_WATCHDOG_TIMEOUT)" in sched["args"]
    # The gateway's read timeouts and the tokenizer's readiness bounds, from the ConfigMap.
    gw = container(by(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"], "gateway")
    assert [a for a in gw["args"] if a.startswith("--http-")] == [
        "--http-header-timeout=$(GATEWAY_HTTP_HEADER_TIMEOUT)", "--http-body-timeout=$(GATEWAY_HTTP_BODY_TIMEOUT)",
        "--http-idle-timeout=$(GATEWAY_HTTP_IDLE_TIMEOUT)"]
    tok = container(by(docs, "Deployment", f"{FULL}-tokenizer")["spec"]["template"]["spec"], "tokenizer")
    assert [a for a in tok["args"] if a.startswith("--readiness-")] == [
        "--readiness-check-interval=$(TOKENIZER_READINESS_CHECK_INTERVAL)",
        "--readiness-check-timeout=$(TOKENIZER_READINESS_CHECK_TIMEOUT)",
        "--readiness-stall-timeout=$(TOKENIZER_READINESS_STALL_TIMEOUT)"]
    data = by(docs, "ConfigMap", f"{FULL}-config")["data"]
    assert {k: v for k, v in data.items() if k.startswith(("GATEWAY_HTTP_", "TOKENIZER_READINESS_"))} == {
        "GATEWAY_HTTP_HEADER_TIMEOUT": "10", "GATEWAY_HTTP_BODY_TIMEOUT": "20", "GATEWAY_HTTP_IDLE_TIMEOUT": "90",
        "TOKENIZER_READINESS_CHECK_INTERVAL": "2", "TOKENIZER_READINESS_CHECK_TIMEOUT": "3",
        "TOKENIZER_READINESS_STALL_TIMEOUT": "120"}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["model"]["persistentVolumeClaim"] == {"claimName": "llama-models", "readOnly": True}
    assert vols["dshm"]["emptyDir"]["sizeLimit"] == "8Gi"
    assert next(m for m in sched["volumeMounts"] if m["name"] == "model")["subPath"] == "hf"
    cm = by(docs, "ConfigMap", f"{FULL}-config")["data"]
    assert cm["SCHEDULER_DTYPE"] == "bfloat16" and cm["SCHEDULER_POLICY"] == "lpm"
    assert cm["MODEL_DIR"] == "/models/Llama-3.1-8B-Instruct"
    # Every tokenizer pod reaches both replica pods by their StatefulSet DNS names.
    tok = container(by(docs, "Deployment", f"{FULL}-tokenizer")["spec"]["template"]["spec"], "tokenizer")
    hosts = [f"{FULL}-replica-{i}.{FULL}-replica.{NAMESPACE}.svc.cluster.local" for i in (0, 1)]
    assert [a for a in tok["args"] if a.startswith("--replica")] == [f"--replica={h}:30020,{h}:30030" for h in hosts]
    assert cm["TOKENIZER_ADDR"] == f"dns:///{FULL}-tokenizer.{NAMESPACE}.svc.cluster.local:30010"

    hpa = by(docs, "HorizontalPodAutoscaler", f"{FULL}-tokenizer")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULL}-tokenizer"}
    assert "replicas" not in by(docs, "Deployment", f"{FULL}-tokenizer")["spec"]
    by(docs, "HorizontalPodAutoscaler", f"{FULL}-gateway")
    for comp in ("gateway", "tokenizer", "replica"):
        by(docs, "PodDisruptionBudget", f"{FULL}-{comp}")
    sm = by(docs, "ServiceMonitor", f"{FULL}-gateway")
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["spec"]["endpoints"][0]["port"] == "http" and sm["spec"]["endpoints"][0]["path"] == "/metrics"
    # Every ServiceMonitor endpoint names a port of the Service it selects.
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    names = sorted(m["metadata"]["name"] for m in monitors)
    assert names == [f"{FULL}-gateway", f"{FULL}-replica", f"{FULL}-tokenizer"]
    for m in monitors:
        component = m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
        svc = by(docs, "Service", f"{FULL}-{component}")
        assert svc["metadata"]["labels"].items() >= m["spec"]["selector"]["matchLabels"].items()
        ports = {p["name"] for p in svc["spec"]["ports"]}
        assert {e["port"] for e in m["spec"]["endpoints"]} <= ports
        assert all(e["path"] == "/metrics" and e["interval"] == "15s" for e in m["spec"]["endpoints"])
    assert [e["port"] for e in by(docs, "ServiceMonitor", f"{FULL}-replica")["spec"]["endpoints"]] == [
        "metrics-sched", "metrics-detok"]

    notes = render_notes(helm, "gpu-multi")
    assert "connects to all 2 replica pod(s)" in notes and f"{FULL}-replica-0.{FULL}-replica.{NAMESPACE}" in notes
    assert "round_robin" in notes and "WARNING" not in notes
    assert "connects to all 1 replica pod(s)" in render_notes(helm, "cpu-single")
    assert "9020 (scheduler)" in notes
    assert f"ServiceMonitors {FULL}-gateway, {FULL}-tokenizer and {FULL}-replica" in notes


def test_tls_and_api_key(rendered: dict[str, list[dict]]) -> None:
    docs = rendered["tls-apikey"]
    key_secret = by(docs, "Secret", f"{FULL}-api-key")
    assert base64.b64decode(key_secret["data"]["api-key"]).decode() == "sk-test-not-a-real-key"
    tls_secret = by(docs, "Secret", f"{FULL}-tls")
    assert tls_secret["type"] == "kubernetes.io/tls"
    assert set(tls_secret["data"]) == {"tls.crt", "tls.key"}

    gw = container(by(docs, "Deployment", f"{FULL}-gateway")["spec"]["template"]["spec"], "gateway")
    env = {e["name"]: e for e in gw["env"]}
    assert env["RINGSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": f"{FULL}-api-key", "key": "api-key"}
    # The gateway and the tokenizer read the variable themselves: no key on a command line.
    tok = container(by(docs, "Deployment", f"{FULL}-tokenizer")["spec"]["template"]["spec"], "tokenizer")
    assert {e["name"]: e for e in tok["env"]}["RINGSERVE_API_KEY"] == env["RINGSERVE_API_KEY"]
    for c in (gw, tok):
        assert not [a for a in c["args"] if "api-key" in a.lower() or "API_KEY" in a]
    # The key never appears in plain text outside the Secret.
    for d in docs:
        if d["kind"] != "Secret":
            assert "sk-test-not-a-real-key" not in yaml.safe_dump(d)

    ing = by(docs, "Ingress", f"{FULL}-gateway")["spec"]
    assert ing["ingressClassName"] == "nginx"
    assert ing["tls"] == [{"hosts": ["api.ringserve.test"], "secretName": f"{FULL}-tls"}]
    backend = ing["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": f"{FULL}-gateway", "port": {"name": "http"}}

    for kind, name in (("Deployment", f"{FULL}-tokenizer"), ("StatefulSet", f"{FULL}-replica")):
        pod = by(docs, kind, name)["spec"]["template"]["spec"]
        init = pod["initContainers"][0]
        assert init["image"] == "registry.example.com/models/smollm2:0.1.2"
        assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]
        assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}["model"]


GRPC_TLS_ARGS = ["--tls-cert-file=/etc/ringserve/grpc-tls/tls.crt", "--tls-key-file=/etc/ringserve/grpc-tls/tls.key",
                 "--tls-ca-file=/etc/ringserve/grpc-tls/ca.crt"]


def test_grpc_mutual_tls(rendered: dict[str, list[dict]]) -> None:
    """Every service gets the --tls-* flags and the Secret; gRPC probes (which cannot speak
    TLS) become `ringserve health` with the same flags."""
    docs = rendered["tls-apikey"]
    pods = {"gateway": by(docs, "Deployment", f"{FULL}-gateway"),
            "tokenizer": by(docs, "Deployment", f"{FULL}-tokenizer"),
            "scheduler": by(docs, "StatefulSet", f"{FULL}-replica"),
            "detokenizer": by(docs, "StatefulSet", f"{FULL}-replica")}
    ports = {"tokenizer": 30010, "scheduler": 30020, "detokenizer": 30030}
    for name, workload in pods.items():
        pod = workload["spec"]["template"]["spec"]
        c = container(pod, name)
        assert [a for a in c["args"] if a.startswith("--tls-")] == GRPC_TLS_ARGS, name
        assert {"name": "grpc-tls", "mountPath": "/etc/ringserve/grpc-tls", "readOnly": True} in c["volumeMounts"]
        assert {v["name"]: v for v in pod["volumes"]}["grpc-tls"] == {
            "name": "grpc-tls", "secret": {"secretName": "ringserve-grpc-mtls"}}
        if name in ports:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                # The tokenizer's liveness and startup ask the "liveness" health service.
                service = ["--service=liveness"] if name == "tokenizer" and probe != "readinessProbe" else []
                assert c[probe]["exec"]["command"] == ["ringserve", "health", f"localhost:{ports[name]}",
                                                       *service, *GRPC_TLS_ARGS], (name, probe)
                assert "grpc" not in c[probe]
    # Without grpcTls: plain gRPC probes and no TLS flags.
    plain = container(by(rendered["cpu-single"], "Deployment", f"{FULL}-tokenizer")["spec"]["template"]["spec"],
                      "tokenizer")
    assert plain["readinessProbe"]["grpc"] == {"port": 30010}
    assert not [a for a in plain["args"] if a.startswith("--tls-")]


def test_scheduler_omp_wait_policy_is_set_only_when_asked(helm: Path, rendered) -> None:
    def sched_env(docs: list[dict]) -> list[dict]:
        pod = by(docs, "StatefulSet", f"{FULL}-replica")["spec"]["template"]["spec"]
        return container(pod, "scheduler")["env"]

    assert [e["name"] for e in sched_env(rendered["cpu-single"])] == ["POD_NAME", "RINGSERVE_INTERNAL_TOKEN"]
    docs = render(helm, "cpu-single", "--set", "replica.scheduler.ompWaitPolicy=PASSIVE")
    assert sched_env(docs)[1] == {"name": "OMP_WAIT_POLICY", "value": "PASSIVE"}
    sched = container(by(docs, "StatefulSet", f"{FULL}-replica")["spec"]["template"]["spec"], "scheduler")
    assert sched["resources"]["requests"]["cpu"] == sched["resources"]["limits"]["cpu"] == "4"


def test_api_key_requires_value(helm: Path) -> None:
    out = subprocess.run(
        [str(helm), "template", RELEASE, str(CHART), "--set", "apiKey.enabled=true"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "apiKey.value" in out.stderr


def grpc_api_objects(docs: list[dict]) -> list[tuple[str, str]]:
    return [(d["kind"], d["metadata"]["name"]) for d in docs if d["metadata"]["name"] == f"{FULL}-grpc-api"]


def tokenizer_policy(docs: list[dict]) -> list[dict]:
    return by(docs, "NetworkPolicy", f"{FULL}-tokenizer")["spec"]["ingress"]


def test_grpc_api_off_by_default(rendered: dict[str, list[dict]]) -> None:
    """Without grpcApi.enabled: no Service or Ingress for it, and the tokenizer's gRPC port
    admits the gateway alone (its second rule is the metrics port)."""
    for values in ("defaults", "cpu-single", "gpu-multi", "tls-apikey"):
        docs = rendered[values]
        assert grpc_api_objects(docs) == [], values
        rules = tokenizer_policy(docs)
        assert len(rules) == 2 and rules[1]["ports"] == [{"port": 9010, "protocol": "TCP"}], values
    assert "--api-key" not in yaml.safe_dump_all(rendered["defaults"])


def test_grpc_api_without_tls(rendered: dict[str, list[dict]], helm: Path) -> None:
    docs = rendered["grpc-api"]
    assert sorted(grpc_api_objects(docs)) == [("Ingress", f"{FULL}-grpc-api"), ("Service", f"{FULL}-grpc-api")]
    svc = by(docs, "Service", f"{FULL}-grpc-api")["spec"]
    assert svc["type"] == "LoadBalancer"
    assert svc["ports"] == [
        {"name": "grpc", "port": 443, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "grpc"}]
    tok_dep = by(docs, "Deployment", f"{FULL}-tokenizer")
    assert svc["selector"] == tok_dep["spec"]["selector"]["matchLabels"]
    assert {"name": "grpc", "containerPort": 30010, "protocol": "TCP"} in container(
        tok_dep["spec"]["template"]["spec"], "tokenizer")["ports"]

    ing = by(docs, "Ingress", f"{FULL}-grpc-api")
    assert ing["metadata"]["annotations"] == {
        "nginx.ingress.kubernetes.io/backend-protocol": "GRPC",
        "nginx.ingress.kubernetes.io/proxy-read-timeout": "600",
        "nginx.ingress.kubernetes.io/proxy-send-timeout": "600",
    }
    assert ing["spec"]["ingressClassName"] == "nginx" and "tls" not in ing["spec"]
    rule = ing["spec"]["rules"][0]
    assert rule["host"] == "grpc.ringserve.test"
    assert rule["http"]["paths"][0]["backend"]["service"] == {"name": f"{FULL}-grpc-api", "port": {"name": "grpc"}}

    # The NetworkPolicy: the gateway, then grpcApi.allowedFrom, to the gRPC port; then metrics.
    rules = tokenizer_policy(docs)
    assert rules[0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert rules[1] == {"ports": [{"port": 30010, "protocol": "TCP"}], "from": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}},
        {"ipBlock": {"cidr": "10.20.0.0/16"}}]}
    assert rules[2]["ports"] == [{"port": 9010, "protocol": "TCP"}]

    # The key: the gateway's Secret (an existing one here), in both containers' environment.
    ref = {"secretKeyRef": {"name": "team-api-keys", "key": "keys"}}
    for kind, name in (("gateway", "gateway"), ("tokenizer", "tokenizer")):
        c = container(by(docs, "Deployment", f"{FULL}-{kind}")["spec"]["template"]["spec"], name)
        assert {e["name"]: e.get("valueFrom") for e in c["env"]}["RINGSERVE_API_KEY"] == ref
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == [f"{FULL}-internal-token"]

    assert ('grpcurl -plaintext -H "authorization: Bearer $API_KEY" grpc.ringserve.test:80 '
            'ringserve.v1.Tokenizer/GetModelInfo') in render_notes(helm, "grpc-api")
    assert ('grpcurl -H "authorization: Bearer $API_KEY" grpc.ringserve.test:443 '
            'ringserve.v1.Tokenizer/GetModelInfo') in render_notes(helm, "grpc-api-tls")
    assert "ringserve.v1.Tokenizer" not in render_notes(helm, "tls-apikey")


def test_grpc_api_with_tls(rendered: dict[str, list[dict]], helm: Path) -> None:
    """Client TLS ends at the Ingress (its own Secret); to the tokenizer, which speaks mutual
    TLS under grpcTls, nginx speaks GRPCS with the grpcTls Secret's client certificate."""
    docs = rendered["grpc-api-tls"]
    svc = by(docs, "Service", f"{FULL}-grpc-api")["spec"]
    assert svc["type"] == "ClusterIP" and svc["ports"][0]["port"] == 30010
    ing = by(docs, "Ingress", f"{FULL}-grpc-api")
    assert ing["metadata"]["annotations"] == {
        "nginx.ingress.kubernetes.io/backend-protocol": "GRPCS",
        "nginx.ingress.kubernetes.io/proxy-ssl-secret": f"{NAMESPACE}/ringserve-grpc-mtls",
        "nginx.ingress.kubernetes.io/proxy-ssl-verify": "on",
        "nginx.ingress.kubernetes.io/proxy-ssl-name": f"{FULL}-tokenizer.{NAMESPACE}.svc.cluster.local",
        "nginx.ingress.kubernetes.io/proxy-ssl-server-name": "on",
        "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600",  # the values' own annotation wins
        "nginx.ingress.kubernetes.io/proxy-send-timeout": "600",
    }
    assert ing["spec"]["tls"] == [{"hosts": ["grpc.ringserve.test"], "secretName": "grpc-ringserve-test-tls"}]
    assert tokenizer_policy(docs)[1] == {"ports": [{"port": 30010, "protocol": "TCP"}]}  # no allowedFrom: any
    tok = container(by(docs, "Deployment", f"{FULL}-tokenizer")["spec"]["template"]["spec"], "tokenizer")
    assert [a for a in tok["args"] if a.startswith("--tls-")] == GRPC_TLS_ARGS
    assert {e["name"]: e.get("valueFrom") for e in tok["env"]}["RINGSERVE_API_KEY"] == {
        "secretKeyRef": {"name": f"{FULL}-api-key", "key": "api-key"}}
    for d in docs:
        if d["kind"] != "Secret":
            assert "sk-test-not-a-real-key" not in yaml.safe_dump(d)
    # Without its own tlsSecret the Ingress uses the tls.* Secret.
    own = render(helm, "grpc-api-tls", "--set", "grpcApi.ingress.tlsSecret=")
    assert by(own, "Ingress", f"{FULL}-grpc-api")["spec"]["tls"][0]["secretName"] == f"{FULL}-tls"


def test_grpc_api_requires_an_api_key(helm: Path) -> None:
    out = subprocess.run(
        [str(helm), "template", RELEASE, str(CHART), "--set", "grpcApi.enabled=true"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "grpcApi.enabled needs apiKey.enabled" in out.stderr


def test_scheduler_deterministic_inference_flag(helm: Path, rendered) -> None:
    def sched_args(docs: list[dict]) -> list[str]:
        pod = by(docs, "StatefulSet", f"{FULL}-replica")["spec"]["template"]["spec"]
        return [a for a in container(pod, "scheduler")["args"] if "deterministic" in a]

    assert sched_args(rendered["cpu-single"]) == []  # auto: the scheduler's default
    assert sched_args(render(helm, "cpu-single", "--set", "config.scheduler.deterministicInference=true")) == [
        "--enable-deterministic-inference"]
    assert sched_args(render(helm, "cpu-single", "--set", "config.scheduler.deterministicInference=false")) == [
        "--disable-deterministic-inference"]
    out = subprocess.run([str(helm), "template", RELEASE, str(CHART), "--set",
                          "config.scheduler.deterministicInference=sometimes"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "deterministicInference" in out.stderr


def test_scheduler_quantization_flag(helm: Path, rendered) -> None:
    def sched_args(docs: list[dict]) -> list[str]:
        pod = by(docs, "StatefulSet", f"{FULL}-replica")["spec"]["template"]["spec"]
        return [a for a in container(pod, "scheduler")["args"] if "quantization" in a]

    assert sched_args(rendered["cpu-single"]) == []  # "": the checkpoint's weights
    for method in ("int8", "int8wo"):
        assert sched_args(render(helm, "cpu-single", "--set", f"config.scheduler.quantization={method}")) == [
            f"--quantization={method}"]
    out = subprocess.run([str(helm), "template", RELEASE, str(CHART), "--set",
                          "config.scheduler.quantization=int4"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "quantization" in out.stderr


@pytest.mark.parametrize("tp_size", [1, 2, 8])
def test_replica_tensor_parallel(helm: Path, tp_size: int) -> None:
    """replica.tpSize N: the replica pod asks for N GPUs and its scheduler runs N ranks."""
    docs = render(helm, "gpu-multi", "--set", f"replica.tpSize={tp_size}")
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) not in CRD_KINDS:
            kv_utils.validate(doc, K8S_VERSION, strict=True)
    sched = container(by(docs, "StatefulSet", f"{FULL}-replica")["spec"]["template"]["spec"], "scheduler")
    assert sched["resources"]["limits"]["nvidia.com/gpu"] == tp_size
    assert sched["resources"]["requests"]["nvidia.com/gpu"] == tp_size
    assert [a for a in sched["args"] if a.startswith("--tp-size")] == ([f"--tp-size={tp_size}"] if tp_size > 1 else [])
