"""Offline validation of custom resources against the CRD schemas vendored in
tests/deploy/schemas (each file names its upstream repository and release tag).

kubernetes-validate knows only the built-in kinds; a custom resource is checked here against
its CRD's ``openAPIV3Schema`` with jsonschema. Made strict the way kubernetes-validate's
``strict=True`` is: an object schema that lists its properties admits no others (the API
server would prune an unknown field silently, so a misspelt key would be lost). The CEL
rules (``x-kubernetes-validations``) are not evaluated; tests check the ones that matter.
"""

from __future__ import annotations

import functools
from typing import Any

import jsonschema
import yaml
from kubernetes_validate import utils as kv_utils

from tests.helpers.repo import REPO

K8S_VERSION = "1.31.0"  # kubernetes-validate ships its schemas; matches the kubectl-v31 layer
SERVICE_MONITOR = ("monitoring.coreos.com/v1", "ServiceMonitor")  # no vendored schema: test_helm_chart checks it

SCHEMAS = REPO / "tests" / "deploy" / "schemas"


def _strict(node: Any) -> Any:
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the strict JSON schema of every vendored CRD version that is served."""
    out = {}
    for path in sorted(SCHEMAS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served", True):
                out[(f"{group}/{version['name']}", kind)] = _strict(version["schema"]["openAPIV3Schema"])
    return out


def validate_custom(doc: dict) -> None:
    """Validate one custom resource against its vendored CRD.

    Raises:
        KeyError: no vendored CRD has the document's apiVersion and kind.
        jsonschema.ValidationError: the document does not match the schema.
    """
    schema = crd_schemas()[(doc["apiVersion"], doc["kind"])]
    jsonschema.validate(doc, schema, cls=jsonschema.Draft7Validator)


def validate_rendered(docs: list[dict]) -> set[str]:
    """Validate rendered manifests offline, strictly: built-in kinds with kubernetes-validate,
    custom resources against their vendored CRDs (a ServiceMonitor is skipped). Returns the
    kinds checked against a CRD.

    Raises:
        kubernetes_validate.ValidationError, jsonschema.ValidationError: a document does not match.
    """
    custom = set()
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key == SERVICE_MONITOR:
            continue
        if key in crd_schemas():
            validate_custom(doc)
            custom.add(doc["kind"])
        else:
            kv_utils.validate(doc, K8S_VERSION, strict=True)
    return custom
