"""`helm lint --strict` and `helm template` pass for the default values and every
example, and the examples cover what the chart promises."""

import pytest

from tests.helm.render import CASES, EXAMPLES, helm_run, render
from tests.tools import CHART


@pytest.mark.parametrize("case", sorted(CASES))
def test_lint_strict(case):
    done = helm_run("lint", "--strict", str(CHART), *CASES[case])
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("case", sorted(CASES))
def test_template_renders(case):
    kinds = {d["kind"] for d in render(case)}
    assert {"RayCluster", "Deployment", "Service", "ConfigMap"} <= kinds


def test_examples_cover_cpu_gpu_and_autoscaling_with_mtls_and_monitoring():
    assert {f.stem for f in EXAMPLES.glob("*.yaml")} >= {
        "cpu-demo", "gpu-1verifier-2drafters", "autoscaling-mtls-monitoring"}
    full = {d["kind"] for d in render("autoscaling-mtls-monitoring")}
    assert {"PodMonitor", "ServiceMonitor", "PrometheusRule", "NetworkPolicy"} <= full
