"""`verifier.tensorParallelSize` and `drafter.tensorParallelSize` (issue 22 item 5): a
member is a group of N ranks in one pod, so a GPU pod has one GPU per rank; the stack
config the members read carries the size and the GPUs the member's actor asks Ray for;
the RayCluster still validates against the vendored KubeRay CRD; and every combination
that cannot work is refused with a message naming it."""

from __future__ import annotations

import pytest

from tests.helm.crds import validation_errors
from tests.helm.render import HelmError, one, render, stack_config, template, worker_group


def gpu_pods(role: str, gpus: int) -> tuple[str, ...]:
    key = f"{role}.resources.%s.nvidia\\.com/gpu={gpus}"
    return ("--set", key % "limits", "--set", key % "requests")


def tp(role: str, size: int) -> tuple[str, ...]:
    return ("--set", f"{role}.tensorParallelSize={size}")


@pytest.mark.parametrize("size", [1, 2, 4])
def test_a_gpu_group_gets_one_gpu_per_rank_in_its_pod_and_config(size):
    docs = template(*tp("verifier", size), *gpu_pods("verifier", size),
                    *tp("drafter", size), *gpu_pods("drafter", size))
    config = stack_config(docs)
    for role in ("verifier", "drafter"):
        container = worker_group(docs, role)["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == size
        rc = config.role(role)
        assert (rc.tensor_parallel_size, rc.num_gpus, rc.device) == (size, size, "cuda")
        # still one member per pod: its actor asks for all the role units a pod offers
        params = worker_group(docs, role)["rayStartParams"]
        assert f'\\"{rc.resource}\\":{int(rc.resource_amount)}' in params["resources"]
    assert validation_errors(one(docs, "RayCluster")) == []


def test_sizes_are_per_role_and_one_by_default():
    assert stack_config(template()).verifier.tensor_parallel_size == 1
    config = stack_config(template(*tp("verifier", 2)))  # CPU pods: gloo ranks
    assert (config.verifier.tensor_parallel_size, config.drafter.tensor_parallel_size) == (2, 1)
    assert config.verifier.num_gpus == 0


def test_heads_the_size_shards_are_accepted():
    heads = ("--set", "model.numAttentionHeads=32", "--set", "model.numKeyValueHeads=2")
    config = stack_config(template(*heads, *tp("verifier", 4), *tp("drafter", 2)))
    assert (config.verifier.tensor_parallel_size, config.drafter.tensor_parallel_size) == (4, 2)


@pytest.mark.parametrize("args, needle", [
    (tp("verifier", 3), "verifier.tensorParallelSize must be one of the following: 1, 2, 4, 8"),
    (tp("drafter", 0), "drafter.tensorParallelSize must be one of the following"),
    (tp("drafter", 16), "drafter.tensorParallelSize must be one of the following"),
    ((*tp("verifier", 4), *gpu_pods("verifier", 2)),
     "verifier.tensorParallelSize 4 needs 4 GPUs in the pod (one per rank), but "
     "verifier.resources.limits nvidia.com/gpu is 2"),
    ((*tp("drafter", 2), *gpu_pods("drafter", 4)),
     "drafter.tensorParallelSize 2 needs 2 GPUs in the pod"),
    ((*tp("verifier", 4), "--set", "model.numAttentionHeads=6"),
     "verifier.tensorParallelSize 4 does not divide model.numAttentionHeads 6"),
    ((*tp("drafter", 4), "--set", "model.numKeyValueHeads=6"),
     "drafter.tensorParallelSize 4 does not divide model.numKeyValueHeads 6"),
    ((*tp("verifier", 8), "--set", "model.numKeyValueHeads=3"),
     "verifier.tensorParallelSize 8 is not a multiple of model.numKeyValueHeads 3"),
    ((*tp("drafter", 2), "--set", "drafter.mode=local"),
     "drafter.tensorParallelSize > 1 needs drafter.mode remote"),
    (("--set", "model.numAttentionHeads=0"), "model.numAttentionHeads"),
])
def test_impossible_combinations_are_refused_by_name(args, needle):
    with pytest.raises(HelmError) as e:
        template(*args)
    assert needle in str(e.value)


def test_the_example_renders_its_groups():
    docs = render("gpu-tensor-parallel")
    config = stack_config(docs)
    assert (config.verifier.tensor_parallel_size, config.verifier.num_gpus) == (4, 4)
    assert (config.drafter.tensor_parallel_size, config.drafter.num_gpus) == (2, 2)
