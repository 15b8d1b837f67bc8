"""`drafter.autoscale`: the controller's drafter autoscaler. The stack config the chart
renders carries the policy with the drafter group's pod bounds (one actor per pod) and
starts at minReplicas; the gateway's boot leaves the drafter count to it; the controller's
/metrics port is declared on the head, scraped by a PodMonitor labelled
role=controller and let through the NetworkPolicy. Values that cannot work are refused
by name."""

import json

import pytest
import yaml

from chainspec.cluster.autoscale import AutoscalePolicy
from tests.helm.render import (
    CASES,
    HelmError,
    of_kind,
    one,
    pod_templates,
    selects,
    stack_config,
    template,
    worker_group,
)
from tests.tools import CHART

DEFAULTS = yaml.safe_load((CHART / "values.yaml").read_text())["drafter"]["autoscale"]
EXAMPLE = CASES["autoscaling-mtls-monitoring"]  # drafter.autoscale on, 1-8 drafter pods
ON = ("--set", "drafter.autoscaling=true", "--set", "drafter.autoscale.enabled=true")


def head_container(docs) -> dict:
    spec = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    return spec["containers"][0]


def container_port(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def test_example_policy_reaches_the_stack_config():
    docs = template(*EXAMPLE)
    config = stack_config(docs)
    group = worker_group(docs, "drafter")
    assert config.drafter.autoscale == AutoscalePolicy(
        min_drafters=group["minReplicas"], max_drafters=group["maxReplicas"],
        target_occupancy=0.7, draft_wait_high_s=0.015, draft_wait_low_s=0.005,
        up_window_s=5, down_window_s=120, cooldown_s=10, interval_s=1)
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 8)
    assert config.drafter.replicas == group["minReplicas"]  # the starting count
    # a drafter actor waiting for its new pod is not declared dead before `up` gives up
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert config.start_timeout_s == values["stack"]["startTimeoutSeconds"]


@pytest.mark.parametrize("low, high", [(0, 3), (2, 6), (5, 5)])
def test_bounds_are_the_drafter_groups(low, high):
    config = stack_config(template(*ON, "--set", f"drafter.minReplicas={low}",
                                   "--set", f"drafter.maxReplicas={high}",
                                   "--set", "drafter.autoscale.cooldownSeconds=3"))
    policy = config.drafter.autoscale
    assert (policy.min_drafters, policy.max_drafters) == (low, high)
    assert config.drafter.replicas == low
    assert policy.cooldown_s == 3 and policy.target_occupancy == 0.75  # the defaults stay


def test_small_thresholds_stay_numbers():
    # Go prints 5e-05, which PyYAML (YAML 1.1) would read as a string
    config = stack_config(template(*ON, "--set-json", "drafter.autoscale.draftWaitLowSeconds=5e-05",
                                   "--set-json", "drafter.autoscale.draftWaitHighSeconds=1e-4"))
    assert config.drafter.autoscale.draft_wait_low_s == pytest.approx(5e-05)
    assert config.drafter.autoscale.draft_wait_high_s == pytest.approx(1e-4)


def test_off_by_default_with_the_controller_port_always_rendered():
    docs = template()
    config = stack_config(docs)
    assert config.drafter.autoscale is None
    assert config.controller_metrics_port == container_port(head_container(docs),
                                                            "ctrl-metrics") == 8081
    # the Ray autoscaler alone (chainspec scale is the knob): no policy either
    assert stack_config(template("--set", "drafter.autoscaling=true")).drafter.autoscale is None


def test_gateway_boot_leaves_the_drafter_count_to_the_controller(booted):
    b = booted("autoscaling-mtls-monitoring")
    assert "drafter" not in {r.resolved["role"] for r in b.of("scale")}
    # `chainspec up --dry-run` (the real CLI) read the policy from the mounted file
    resolved = b.of("up")[0].resolved["config"]
    assert resolved["drafter"]["autoscale"]["max_drafters"] == 8
    assert resolved["controller_metrics_port"] == 8081


def test_head_declares_the_port_and_a_pod_monitor_scrapes_it():
    docs = template(*EXAMPLE)
    port = container_port(head_container(docs), "ctrl-metrics")
    assert port == stack_config(docs).controller_metrics_port
    head = next(pt for pt in pod_templates(docs) if pt.where.endswith(" head"))
    monitors = [m for m in of_kind(docs, "PodMonitor")
                if selects(m["spec"]["selector"], head.labels)]
    assert len(monitors) == 1
    (endpoint,) = monitors[0]["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("ctrl-metrics", "/metrics")
    role = [r for r in endpoint["relabelings"] if r["targetLabel"] == "role"]
    assert role == [{"targetLabel": "role", "replacement": "controller"}]
    policy = one(docs, "NetworkPolicy")["spec"]
    assert selects(policy["podSelector"], head.labels)
    assert port in {p["port"] for p in policy["ingress"][1]["ports"]}  # the scrape rule


def test_no_controller_monitor_without_pod_monitors():
    assert of_kind(template(), "PodMonitor") == []


@pytest.mark.parametrize("args, needle", [
    (("--set", "drafter.autoscale.enabled=true"),
     "drafter.autoscale.enabled needs drafter.autoscaling: true"),
    (("--set", "drafter.autoscale.enabled=true", "--set", "drafter.mode=local"),
     "drafter.autoscale.enabled needs drafter.mode remote"),
    ((*ON, "--set", "drafter.mode=local"), "needs drafter.mode remote"),
    ((*ON, "--set-json", "drafter.autoscale.draftWaitLowSeconds=0.5"),
     "need draftWaitLowSeconds <= draftWaitHighSeconds"),
    ((*ON, "--set", "drafter.minReplicas=5"), "minReplicas <= maxReplicas"),
    (("--set", "head.ports.controllerMetrics=8080"), "head.ports: every port must differ"),
])
def test_values_that_cannot_work_are_refused(args, needle):
    with pytest.raises(HelmError) as e:
        template(*args)
    assert needle in str(e.value)


@pytest.mark.parametrize("args, needle", [
    (("--set", "drafter.autoscale.minDrafters=1"),
     "Additional property minDrafters is not allowed"),
    (("--set", "drafter.autoscale.enabled=yes"), "drafter.autoscale.enabled"),
    (("--set-json", "drafter.autoscale.targetOccupancy=1.5"),
     "drafter.autoscale.targetOccupancy"),
    (("--set-json", "drafter.autoscale.targetOccupancy=0"), "drafter.autoscale.targetOccupancy"),
    (("--set-json", "drafter.autoscale.cooldownSeconds=-1"), "drafter.autoscale.cooldownSeconds"),
    (("--set-json", f"verifier.autoscale={json.dumps(DEFAULTS)}"), "verifier.autoscale"),
])
def test_schema_refuses_the_block_wrong(args, needle):
    with pytest.raises(HelmError) as e:
        template(*args)
    assert needle in str(e.value)
