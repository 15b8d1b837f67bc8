"""Render the chart with `helm template` and look things up in the result."""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import yaml

from chainspec.cluster.config import StackConfig
from tests.tools import CHART, helm

RELEASE, NAMESPACE = "cs", "serving"
EXAMPLES = CHART / "examples"

# name -> extra `helm template` arguments; every example file has a case
CASES: dict[str, tuple[str, ...]] = {
    "default": (),
    **{f.stem: ("-f", str(f)) for f in sorted(EXAMPLES.glob("*.yaml"))},
    # everything optional switched on that can be on together
    "grpc-probes-pvc-secrets": (
        "--set", "drafter.grpc.probes=true", "--set", "verifier.grpc.probes=true",
        "--set", "model.source=pvc", "--set", "model.pvc.claimName=models",
        "--set", "model.dir=m", "--set", "auth.tokenSecret.name=tok",
        "--set", "auth.tokenSecret.key=tk", "--set", "gateway.apiKey.existingSecret=key",
        "--set", "gateway.apiKey.key=ak", "--set", "gateway.trustRequestChatTemplate=true",
        "--set", "head.pdb.enabled=true",
        "--set", "monitoring.podMonitors.enabled=true",
        "--set", "monitoring.serviceMonitor.enabled=true"),
}


class HelmError(RuntimeError):
    pass


def helm_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120)


@functools.cache
def template(*args: str) -> tuple[dict, ...]:
    """The rendered documents of `helm template` with these extra arguments."""
    done = helm_run("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args)
    if done.returncode != 0:
        raise HelmError(done.stderr.strip())
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return tuple(d for d in yaml.load_all(done.stdout, Loader=loader) if d)


def render(case: str) -> tuple[dict, ...]:
    return template(*CASES[case])


def of_kind(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs, kind: str) -> dict:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


@dataclass(frozen=True)
class PodTemplate:
    """A pod template somewhere in the manifests: where, and whether KubeRay owns the
    command of its first container (`ray start`)."""

    where: str
    template: dict
    ray: bool

    @property
    def labels(self) -> dict:
        return self.template.get("metadata", {}).get("labels", {})

    @property
    def spec(self) -> dict:
        return self.template["spec"]


def pod_templates(docs) -> Iterator[PodTemplate]:
    for d in docs:
        name = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield PodTemplate(name, d["spec"]["template"], False)
        elif d["kind"] == "RayCluster":
            yield PodTemplate(f"{name} head", d["spec"]["headGroupSpec"]["template"], True)
            for g in d["spec"].get("workerGroupSpecs", []):
                yield PodTemplate(f"{name} {g['groupName']}", g["template"], True)


def stack_config(docs) -> StackConfig:
    """The stack config `chainspec up --config` reads from the rendered ConfigMap."""
    cm = next(d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-stack"))
    return StackConfig.from_dict(yaml.safe_load(cm["data"]["stack.yaml"]))


def worker_group(docs, role: str) -> dict:
    groups = one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
    return next(g for g in groups if g["groupName"] == role)


def selects(selector: dict, labels: dict) -> bool:
    """Whether a LabelSelector (matchLabels + In/NotIn/Exists/DoesNotExist) matches."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        value, op = labels.get(e["key"]), e["operator"]
        ok = {"In": value in e.get("values", []), "NotIn": value not in e.get("values", []),
              "Exists": e["key"] in labels, "DoesNotExist": e["key"] not in labels}[op]
        if not ok:
            return False
    return True
