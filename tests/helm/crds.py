"""Validate custom resources against upstream CRD schemas (tests/helm/crds) the way the
API server would: the version's openAPIV3Schema, plus the fields it would silently prune
(unknown to a structural schema), which we treat as errors."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import jsonschema
import yaml

from tests.tools import crd_dir

CRD_FILES = {
    ("ray.io", "RayCluster"): "ray.io_rayclusters.yaml",
    ("monitoring.coreos.com", "PodMonitor"): "monitoring.coreos.com_podmonitors.yaml",
    ("monitoring.coreos.com", "ServiceMonitor"): "monitoring.coreos.com_servicemonitors.yaml",
    ("monitoring.coreos.com", "PrometheusRule"): "monitoring.coreos.com_prometheusrules.yaml",
}


def is_custom(doc: dict) -> bool:
    return doc["apiVersion"].split("/")[0] in {group for group, _ in CRD_FILES}


@functools.cache
def version_schema(group: str, kind: str, version: str) -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the RayCluster CRD is ~1 MB
    crd = yaml.load((crd_dir() / CRD_FILES[(group, kind)]).read_text(), Loader=loader)
    assert crd["spec"]["names"]["kind"] == kind
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            assert v.get("served", True), f"{kind} {version} is not served"
            return v["schema"]["openAPIV3Schema"]
    raise AssertionError(f"{kind}: no version {version} in {CRD_FILES[(group, kind)]}")


def validation_errors(doc: dict) -> list[str]:
    """Schema errors and would-be-pruned fields of a custom resource's spec."""
    group, version = doc["apiVersion"].split("/")
    schema = version_schema(group, doc["kind"], version)
    spec_schema = schema["properties"]["spec"]
    validator = jsonschema.Draft4Validator(spec_schema)
    errors = [f"spec.{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator.iter_errors(doc["spec"])]
    errors += [f"{path}: unknown field (the API server would drop it)"
               for path in unknown_fields(doc["spec"], spec_schema, "spec")]
    return errors


def unknown_fields(value, schema: dict, path: str) -> Iterator[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict) and schema.get("type") == "object":
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            if props is not None and key in props:
                yield from unknown_fields(sub, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                yield from unknown_fields(sub, extra, f"{path}.{key}")
            elif props is not None and not extra:
                yield f"{path}.{key}"
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from unknown_fields(item, schema["items"], f"{path}[{i}]")
