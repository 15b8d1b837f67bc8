"""Fixtures of the chart tests: the gateway's boot commands of each case, dry-run once."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.helm.commands import Invocation, dry_run, invocations, sandbox
from tests.helm.render import of_kind, pod_templates, render

CHART_CONTAINERS = {"ray-head", "ray-worker", "gateway"}  # the chart's own containers


@dataclass(frozen=True)
class Run:
    invocation: Invocation
    argv: tuple[str, ...]  # as run here (mounted paths mapped into the sandbox)
    resolved: dict  # what --dry-run printed


@dataclass(frozen=True)
class Booted:
    """The chainspec commands of every non-Ray container of a case, each dry-run."""

    docs: tuple[dict, ...]
    runs: tuple[Run, ...]

    def of(self, command: str) -> list[Run]:
        return [r for r in self.runs if r.invocation.command == command]


@pytest.fixture(scope="session")
def booted(tmp_path_factory):
    cache: dict[str, Booted] = {}

    def get(case: str) -> Booted:
        if case not in cache:
            cache[case] = _boot(case, tmp_path_factory.mktemp(case))
        return cache[case]
    return get


def _boot(case: str, root) -> Booted:
    docs = render(case)
    configmaps = {d["metadata"]["name"]: d for d in of_kind(docs, "ConfigMap")}
    runs = []
    with pytest.MonkeyPatch.context() as mp:
        for name in ("CHAINSPEC_AUTH_TOKEN", "CHAINSPEC_API_KEY"):
            mp.delenv(name, raising=False)  # only what the manifests give
        for pt in pod_templates(docs):
            containers = pt.spec.get("initContainers", []) + pt.spec["containers"]
            for i, c in enumerate(containers):
                if pt.ray and c is pt.spec["containers"][0]:
                    continue  # KubeRay's `ray start` (checked in test_wiring)
                if c["name"] not in CHART_CONTAINERS:
                    continue  # the values' own initContainers and sidecars
                for n, inv in enumerate(invocations(c)):
                    argv = sandbox(pt.spec, c, configmaps, root / f"{c['name']}-{i}-{n}",
                                   inv.argv)
                    runs.append(Run(inv, argv, dry_run(argv)))
    return Booted(docs, tuple(runs))
