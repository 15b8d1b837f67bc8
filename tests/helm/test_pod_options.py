"""The chart's pod options and head fault tolerance (issue 22 items 6-7): with every value
set (examples/production-pod-options.yaml) each lands where Kubernetes and KubeRay read it,
the RayCluster carries gcsFaultToleranceOptions and validates against the vendored
KubeRay v1.7.0 CRD (test_schemas checks every case), the drafters' preStop hook is a
`chainspec drain --self` that parses and names the stack the gateway boots, and the
schema or the templates refuse values that cannot work."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from chainspec.cli import main
from tests.helm.crds import validation_errors
from tests.helm.render import CASES, HelmError, of_kind, one, template, worker_group

CASE = CASES["production-pod-options"]
POD_OPTIONS = ("priorityClassName", "runtimeClassName", "topologySpreadConstraints",
               "initContainers")


def pods(docs) -> dict[str, dict]:
    """Pod spec per block: head, verifier, drafter, gateway."""
    cluster = one(docs, "RayCluster")["spec"]
    out = {"head": cluster["headGroupSpec"]["template"]["spec"],
           "gateway": one(docs, "Deployment")["spec"]["template"]["spec"]}
    for role in ("verifier", "drafter"):
        out[role] = worker_group(docs, role)["template"]["spec"]
    return out


def values_of(block: str) -> dict:
    return yaml.safe_load(Path(CASE[1]).read_text())[block]


@pytest.mark.parametrize("block", ["head", "verifier", "drafter", "gateway"])
def test_every_pod_option_lands_in_its_pod(block):
    spec, v = pods(template(*CASE))[block], values_of(block)
    for key in POD_OPTIONS:
        assert spec[key] == v[key], key
    main_container, *rest = spec["containers"]
    assert main_container["name"] in ("ray-head", "ray-worker", "gateway")  # Ray's first
    assert rest == v["sidecars"]
    assert main_container["envFrom"] == v["envFrom"]


@pytest.mark.parametrize("block", ["head", "verifier", "drafter"])
def test_ray_groups_get_shm_and_their_ray_start_flags(block):
    docs = template(*CASE)
    cluster = one(docs, "RayCluster")["spec"]
    group = cluster["headGroupSpec"] if block == "head" else worker_group(docs, block)
    v = values_of(block)
    assert group["rayStartParams"]["object-store-memory"] == v["extraArgs"]["object-store-memory"]
    assert "resources" in group["rayStartParams"]  # the chart's own stay
    spec = group["template"]["spec"]
    shm = next(vol for vol in spec["volumes"] if vol["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": v["shm"]["sizeLimit"]}
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"


def test_the_head_has_no_cpus_and_gcs_fault_tolerance_from_the_secret():
    cluster = one(template(*CASE), "RayCluster")
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert cluster["spec"]["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis.redis.svc.cluster.local:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis-password",
                                                         "key": "password"}}},
        "externalStorageNamespace": "chainspec-prod"}
    assert validation_errors(cluster) == []
    broken = copy.deepcopy(cluster)  # the check can fail: a misspelled field is caught
    broken["spec"]["gcsFaultToleranceOptions"]["redisPasword"] = {"value": "x"}
    assert validation_errors(broken)
    assert "gcsFaultToleranceOptions" not in one(template(), "RayCluster")["spec"]


def test_the_gateway_behind_an_ingress_with_an_hpa():
    docs = template(*CASE)
    service = one(docs, "Service")
    ingress = one(docs, "Ingress")["spec"]
    assert ingress["ingressClassName"] == "nginx"
    backend = ingress["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend["name"] == service["metadata"]["name"] and backend["port"]["name"] == "http"
    assert ingress["rules"][0]["host"] == "llm.example.com"
    hpa = one(docs, "HorizontalPodAutoscaler")["spec"]
    deployment = one(docs, "Deployment")
    assert hpa["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 8)
    assert {m["resource"]["name"] for m in hpa["metrics"]} == {"cpu", "memory"}
    assert "replicas" not in deployment["spec"]  # the HPA owns the count
    assert "'--max-in-flight' '512'" in deployment["spec"]["template"]["spec"][
        "containers"][0]["args"][0]
    assert not of_kind(template(), "Ingress") and not of_kind(template(), "HorizontalPodAutoscaler")


def test_an_httproute_to_the_gateway_service():
    docs = template("--set", "gateway.httpRoute.enabled=true",
                    "--set", "gateway.httpRoute.parentRefs[0].name=public",
                    "--set", "gateway.httpRoute.hostnames[0]=llm.example.com")
    route = one(docs, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    spec, service = route["spec"], one(docs, "Service")
    assert spec["parentRefs"] == [{"name": "public"}]
    assert spec["hostnames"] == ["llm.example.com"]
    assert spec["rules"][0]["backendRefs"] == [
        {"name": service["metadata"]["name"], "port": service["spec"]["ports"][0]["port"]}]


@pytest.mark.parametrize("role", ["drafter", "verifier"])
def test_prestop_drains_this_pods_member_of_the_stack_the_gateway_boots(role, capsys):
    docs = template(*CASE)
    container = worker_group(docs, role)["template"]["spec"]["containers"][0]
    argv = container["lifecycle"]["preStop"]["exec"]["command"]
    assert argv[:2] == ["chainspec", "drain"]
    assert main([*argv[1:], "--dry-run"]) == 0  # the real CLI parses it
    resolved = json.loads(capsys.readouterr().out)
    gateway = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert resolved["self"] and resolved["role"] == role
    assert f"--address {resolved['address']} --namespace {resolved['namespace']}" in gateway
    env = {e["name"]: e for e in container["env"]}
    assert env["CHAINSPEC_NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    off = template("--set", f"{role}.drainOnStop=false")
    assert "lifecycle" not in worker_group(off, role)["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("extra, message", [
    (("--set", "head.gcsFaultTolerance.enabled=true"), "redisAddress"),
    (("--set", "head.gcsFaultTolerance.enabled=true",
      "--set", "head.gcsFaultTolerance.redisAddress=redis"), "redisAddress"),  # no port
    (("--set", "drafter.extraArgs.resources=x"), "drafter.extraArgs: \"resources\" is set by"),
    (("--set-string", "head.extraArgs.num-cpus=4"), "head.extraArgs: \"num-cpus\" is set by"),
    (("--set", "drafter.terminationGracePeriodSeconds=30"), "must exceed stack.drainTimeout"),
    (("--set", "gateway.ingress.enabled=true", "--set", "gateway.ingress.hosts=null"), "hosts"),
    (("--set", "gateway.httpRoute.enabled=true"), "parentRefs"),
    (("--set", "gateway.autoscaling.enabled=true",
      "--set", "gateway.autoscaling.minReplicas=5"), "minReplicas <= maxReplicas"),
    (("--set", "verifier.shm.sizeLimit=lots"), "sizeLimit"),
    (("--set", "gateway.extraArgs[0]=it's"), "extraArgs"),
    (("--set", "gateway.ingress.hostz=x"), "hostz"),
])
def test_values_that_cannot_work_are_refused(extra, message):
    with pytest.raises(HelmError, match=message):
        template(*extra)
