"""Every rendered object is valid: core objects (and the RayCluster's pod templates) by
kubernetes-validate in strict mode for the newest Kubernetes it knows, custom resources
by their upstream CRD schemas (KubeRay v1.7.0 RayCluster v1, Prometheus Operator v1), and
the rules KubeRay enforces in Go rather than in its schema."""

import re

import pytest

from tests.helm.crds import is_custom, unknown_fields, validation_errors
from tests.helm.render import CASES, of_kind, one, pod_templates, render
from tests.tools import kubernetes_validate

CASE_NAMES = sorted(CASES)


def _k8s_version() -> str:
    return kubernetes_validate().utils.latest_version()


def _strict_errors(doc: dict) -> str | None:
    kv = kubernetes_validate()
    try:
        kv.validate(doc, _k8s_version(), strict=True)
    except kv.ValidationError as e:
        return f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, e.path))}: " \
               f"{e.message}"
    return None


def test_validates_against_a_current_kubernetes():
    major, minor = map(int, _k8s_version().split(".")[:2])
    assert (major, minor) >= (1, 33)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_core_objects_are_strictly_valid(case):
    errors = [_strict_errors(d) for d in render(case) if not is_custom(d)]
    assert not [e for e in errors if e], "\n".join(e for e in errors if e)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_ray_pod_templates_are_strictly_valid(case):
    # the CRD's embedded PodTemplateSpec schema would let a misspelled field through
    errors = []
    for pt in pod_templates(render(case)):
        if pt.ray:
            doc = {"apiVersion": "v1", "kind": "PodTemplate",
                   "metadata": {"name": pt.where.split("/")[1].replace(" ", "-")},
                   "template": pt.template}
            errors.append(_strict_errors(doc))
    assert not [e for e in errors if e], "\n".join(e for e in errors if e)


@pytest.mark.parametrize("case", CASE_NAMES)
def test_custom_resources_match_upstream_crds(case):
    docs = [d for d in render(case) if is_custom(d)]
    assert docs
    errors = [f"{d['kind']}/{d['metadata']['name']} {e}" for d in docs
              for e in validation_errors(d)]
    assert not errors, "\n".join(errors)


def test_crd_check_catches_a_wrong_type_and_a_misspelled_field():
    cluster = dict(one(render("default"), "RayCluster"))
    spec = dict(cluster["spec"], enableInTreeAutoscalling=True)
    spec["workerGroupSpecs"] = [dict(spec["workerGroupSpecs"][0], replicas="two")]
    errors = validation_errors(dict(cluster, spec=spec))
    assert any("replicas" in e and "not of type" in e for e in errors), errors
    assert any("enableInTreeAutoscalling: unknown field" in e for e in errors), errors
    assert list(unknown_fields({"a": 1}, {"type": "object", "properties": {}}, "x")) == ["x.a"]


# -- rules KubeRay checks in Go (ray-operator utils/validation.go and the webhook) -------

RAY_START_RESOURCES = ("num-cpus", "num-gpus", "memory", "resources")
CONTAINER_TWIN = {"num-cpus": "cpu", "num-gpus": "nvidia.com/gpu", "memory": "memory"}


def _groups(cluster: dict) -> list[tuple[str, dict]]:
    spec = cluster["spec"]
    return [("head", spec["headGroupSpec"])] + [(g["groupName"], g)
                                               for g in spec["workerGroupSpecs"]]


@pytest.mark.parametrize("case", CASE_NAMES)
def test_kuberay_go_rules(case):
    cluster = one(render(case), "RayCluster")
    name = cluster["metadata"]["name"]
    assert len(name) <= 53 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)
    groups = cluster["spec"]["workerGroupSpecs"]
    assert len({g["groupName"] for g in groups}) == len(groups), "group names must be unique"
    autoscaling = cluster["spec"].get("enableInTreeAutoscaling", False)
    for g in groups:
        lo, hi = g.get("minReplicas", 0), g.get("maxReplicas", 2 ** 31 - 1)
        assert lo <= hi, g["groupName"]
        if "replicas" in g:
            assert lo <= g["replicas"] <= hi, g["groupName"]
        else:
            assert autoscaling, f"{g['groupName']}: no replicas without the autoscaler"
    for group_name, g in _groups(cluster):
        _check_group_resources(group_name, g, autoscaling)
    _check_gcs_fault_tolerance(cluster)


def _check_gcs_fault_tolerance(cluster: dict) -> None:
    """KubeRay refuses the FT annotation beside gcsFaultToleranceOptions, and with them a
    redis-password/redis-username start param or RAY_REDIS_ADDRESS/REDIS_PASSWORD in the
    head's env; RAY_REDIS_ADDRESS without them is refused too."""
    spec = cluster["spec"]
    head = spec["headGroupSpec"]
    env = {e["name"] for e in head["template"]["spec"]["containers"][0].get("env", [])}
    annotations = cluster["metadata"].get("annotations", {})
    assert "redis-username" not in head.get("rayStartParams", {})
    if "gcsFaultToleranceOptions" not in spec:
        assert "RAY_REDIS_ADDRESS" not in env
        return
    assert "ray.io/ft-enabled" not in annotations
    assert "ray.io/external-storage-namespace" not in annotations
    assert "redis-password" not in head.get("rayStartParams", {})
    assert not env & {"RAY_REDIS_ADDRESS", "REDIS_PASSWORD"}


def _check_group_resources(group_name: str, g: dict, autoscaling: bool) -> None:
    params = g.get("rayStartParams", {})
    assert not (any(params.get(k) for k in RAY_START_RESOURCES) and g.get("resources")), \
        f"{group_name}: resources in both rayStartParams and the group's resources"
    assert "labels" not in params, f"{group_name}: rayStartParams['labels'] is refused"
    spec = g["template"]["spec"]
    ray_container = spec["containers"][0]
    limits = ray_container.get("resources", {}).get("limits", {})
    for param, twin in CONTAINER_TWIN.items():
        if param == "num-cpus" and params.get(param) == "0":
            continue  # KubeRay's own pattern for a head that runs no workloads
        assert not (param in params and twin in limits), \
            f"{group_name}: {param} in rayStartParams and {twin} in the container's limits"
    if autoscaling:
        assert spec.get("restartPolicy", "Never") == "Never", group_name
    else:
        env = {e["name"]: e.get("value") for e in ray_container.get("env", [])}
        assert env.get("RAY_enable_autoscaler_v2") not in ("1", "true"), group_name


def test_every_monitoring_object_kind_is_checked():
    kinds = {d["kind"] for d in render("autoscaling-mtls-monitoring") if is_custom(d)}
    assert kinds == {"RayCluster", "PodMonitor", "ServiceMonitor", "PrometheusRule"}
    assert len(of_kind(render("autoscaling-mtls-monitoring"), "PodMonitor")) == 3


def test_monitors_label_targets_like_http_sd_discovery():
    """The rules and the dashboard group by `role` and `member`: on Kubernetes the
    monitors must attach the same labels the gateway's http_sd endpoint does."""
    docs = render("autoscaling-mtls-monitoring")
    monitors = of_kind(docs, "PodMonitor") + of_kind(docs, "ServiceMonitor")
    assert len(monitors) == 4  # drafter, verifier, controller; the gateway
    for m in monitors:
        key = "podMetricsEndpoints" if m["kind"] == "PodMonitor" else "endpoints"
        for ep in m["spec"][key]:
            assert {r["targetLabel"] for r in ep["relabelings"]} >= {"role", "member"}
