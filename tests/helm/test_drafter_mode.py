"""`drafter.mode` and `stack.pipelineGroups`: with `local` every verifier drafts in its own
process, so the chart renders nothing of the drafter role (no worker group, budget,
monitor or `scale drafters` at boot) and the stack config it renders makes `chainspec up`
start no drafter actor; `remote` (the default) keeps the drafter group. Values that
cannot mean anything are refused by name."""

import pytest

from tests.helm.render import HelmError, of_kind, one, stack_config, template

LOCAL = ("--set", "drafter.mode=local", "--set", "stack.pipelineGroups=2",
         "--set", "monitoring.podMonitors.enabled=true")


def components(docs, kind: str) -> set[str]:
    return {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in of_kind(docs, kind)}


def gateway_script(docs) -> str:
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"][0]


def test_local_renders_no_drafter_and_a_stack_without_drafter_actors():
    docs = template(*LOCAL)
    groups = one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["verifier"]
    assert "drafter" not in components(docs, "PodDisruptionBudget")
    assert components(docs, "PodMonitor") == {"verifier", "controller"}
    assert "scale drafters" not in gateway_script(docs)
    config = stack_config(docs)
    assert config.drafter.local and config.drafter.replicas == 0  # `up` spawns no drafter
    assert config.pipeline_groups == 2


def test_remote_is_the_default_and_keeps_the_drafter_group():
    docs = template("--set", "monitoring.podMonitors.enabled=true")
    groups = one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
    assert sorted(g["groupName"] for g in groups) == ["drafter", "verifier"]
    assert components(docs, "PodMonitor") == {"drafter", "verifier", "controller"}
    assert "scale drafters 4" in gateway_script(docs)  # maxReplicas > minReplicas
    config = stack_config(docs)
    assert (str(config.drafter.mode), config.drafter.replicas) == ("remote", 0)  # minReplicas
    assert config.pipeline_groups == 1
    assert config.draft_ahead is False


def test_draft_ahead_reaches_the_stack_config():
    config = stack_config(template("--set", "stack.draftAhead=true"))
    assert config.draft_ahead is True


@pytest.mark.parametrize("args, needle", [
    (("--set", "drafter.mode=colocated"), "drafter.mode"),
    (("--set", "verifier.mode=local"), "verifier.mode: only the drafter role has a mode"),
    (("--set", "drafter.mode=local", "--set", "drafter.autoscaling=true"),
     "drafter.autoscaling needs drafter.mode remote"),
    (("--set", "stack.pipelineGroups=0"), "stack.pipelineGroups"),
    (("--set-string", "stack.draftAhead=yes"), "stack.draftAhead"),
])
def test_meaningless_values_are_refused(args, needle):
    with pytest.raises(HelmError) as e:
        template(*args)
    assert needle in str(e.value)
