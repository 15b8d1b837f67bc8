"""Drafters scale independently: `--set drafter.replicas=N` changes the drafter worker
group's replicas and nothing else in the rendered output, and with autoscaling on Helm
sets no replicas for that role at all (the Ray autoscaler owns the pod count)."""

import pytest

from tests.helm.render import CASES, one, template, worker_group


def diff(a, b, path: str = "") -> list[str]:
    """Paths where two rendered values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [p for k in sorted(set(a) | set(b), key=str)
                for p in diff(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [p for i, (x, y) in enumerate(zip(a, b, strict=True))
                for p in diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [path or "."]


_ABSENT = object()


def rendered_diff(case: str, *extra: str) -> list[str]:
    before, after = template(*CASES[case]), template(*CASES[case], *extra)
    assert [(d["kind"], d["metadata"]["name"]) for d in before] == \
        [(d["kind"], d["metadata"]["name"]) for d in after]
    return [f"{d['kind']}/{d['metadata']['name']}{p}"
            for d, e in zip(before, after, strict=True) for p in diff(d, e)]


def test_diff_sees_changes():
    assert diff({"a": [1, {"b": 2}]}, {"a": [1, {"b": 3}], "c": 1}) == [".a[1].b", ".c"]


@pytest.mark.parametrize("case,new", [("default", 3), ("cpu-demo", 2),
                                      ("gpu-1verifier-2drafters", 4)])
def test_drafter_replicas_change_only_the_drafter_group(case, new):
    cluster = one(template(*CASES[case]), "RayCluster")
    index = [g["groupName"] for g in cluster["spec"]["workerGroupSpecs"]].index("drafter")
    assert rendered_diff(case, "--set", f"drafter.replicas={new}") == [
        f"RayCluster/{cluster['metadata']['name']}.spec.workerGroupSpecs[{index}].replicas"]


def test_verifier_replicas_change_only_the_verifier_group():
    changed = rendered_diff("default", "--set", "verifier.maxReplicas=3",
                            "--set", "verifier.replicas=3")
    # maxReplicas also sizes the stack (one actor per pod the group may have)
    assert [c for c in changed if "RayCluster" in c] == [
        "RayCluster/cs-chainspec.spec.workerGroupSpecs[0].maxReplicas",
        "RayCluster/cs-chainspec.spec.workerGroupSpecs[0].replicas"]
    assert not [c for c in changed if "drafter" in c]


def test_autoscaled_role_has_no_helm_replicas():
    docs = template(*CASES["autoscaling-mtls-monitoring"])
    cluster = one(docs, "RayCluster")
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    drafter = worker_group(docs, "drafter")
    assert "replicas" not in drafter
    assert (drafter["minReplicas"], drafter["maxReplicas"]) == (1, 8)
    # the fixed-size verifier is pinned so the autoscaler leaves it alone
    verifier = worker_group(docs, "verifier")
    assert verifier["replicas"] == verifier["minReplicas"] == verifier["maxReplicas"] == 2
    assert rendered_diff("autoscaling-mtls-monitoring", "--set", "drafter.replicas=5") == []


def test_autoscaling_is_off_unless_a_role_asks():
    assert one(template(), "RayCluster")["spec"]["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in one(template(), "RayCluster")["spec"]
