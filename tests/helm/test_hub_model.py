"""`model.source: hub` (examples/hub-model.yaml): every pod that loads the model first
runs the fetch-model init container into the model volume, the members load what it
links, the gateway serves it under the Hub id, and the container's own command, run
here against a cache laid out as huggingface_hub writes it, makes that link."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from chainspec.engine.local import DEMO_MODEL
from tests.helm.render import CASES, HelmError, of_kind, pod_templates, template
from tests.hf_cache import add_to_cache

CASE = CASES["hub-model"]
HUB_ID = "XiaomiMiMo/MiMo-7B-RL"


def model_pods(docs):
    return [pt for pt in pod_templates(docs)
            if any(v["name"] == "model" for v in pt.spec.get("volumes", []))]


def stack_yaml(docs) -> dict:
    cm = next(d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-stack"))
    return yaml.safe_load(cm["data"]["stack.yaml"])


def test_every_pod_that_loads_the_model_fetches_it_first():
    docs = template(*CASE)
    pods = model_pods(docs)
    assert len(pods) == 4  # head, verifier, drafter, gateway
    for pt in pods:
        fetch = pt.spec["initContainers"][0]
        assert fetch["name"] == "fetch-model", pt.where
        assert fetch["args"] == [HUB_ID, "main", "/models/mimo-7b-rl", "/models/hub"]
        assert fetch["volumeMounts"] == [{"name": "model", "mountPath": "/models"}]
        token = next(e for e in fetch["env"] if e["name"] == "HF_TOKEN")
        assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
        [volume] = [v for v in pt.spec["volumes"] if v["name"] == "model"]
        assert volume["persistentVolumeClaim"] == {"claimName": "hf-models"}
        main = pt.spec["containers"][0]
        [mount] = [m for m in main["volumeMounts"] if m["name"] == "model"]
        assert mount["readOnly"] is True  # only the init container writes
    model = stack_yaml(docs).get("model", stack_yaml(docs).get("model_dir"))
    assert model == "/models/mimo-7b-rl"  # the members load the fetched link


def test_the_gateway_serves_the_hub_id_unless_model_name_says_otherwise():
    def gateway_script(*extra: str) -> str:
        [deploy] = [d for d in of_kind(template(*CASE, *extra), "Deployment")]
        return " ".join(deploy["spec"]["template"]["spec"]["containers"][0]["args"])
    assert f"--served-model-name {HUB_ID}" in gateway_script()
    assert "--served-model-name mine" in gateway_script("--set", "model.name=mine")


def test_without_a_pvc_each_pod_has_an_empty_dir_and_its_own_init_containers_follow():
    docs = template("--set", "model.source=hub", "--set", "model.hub.id=org/name",
                    "--set", "model.hub.sizeLimit=20Gi",
                    "--set", "verifier.initContainers[0].name=warm",
                    "--set", "verifier.initContainers[0].image=busybox")
    for pt in model_pods(docs):
        [volume] = [v for v in pt.spec["volumes"] if v["name"] == "model"]
        assert volume["emptyDir"] == {"sizeLimit": "20Gi"}, pt.where
        names = [c["name"] for c in pt.spec["initContainers"]]
        assert names == (["fetch-model", "warm"] if pt.where.endswith("verifier")
                         else ["fetch-model"]), pt.where
        assert pt.spec["initContainers"][0]["args"][2] == "/models/model"  # dir default
        assert not any(e["name"] == "HF_TOKEN" for e in pt.spec["initContainers"][0]["env"])
    assert all("initContainers" not in pt.spec for pt in pod_templates(template()))


@pytest.mark.parametrize("values,message", [
    (("--set", "model.source=hub"), "model.hub.id"),
    (("--set", "model.source=hub", "--set", "model.hub.id=a/b/c"), "model.hub.id"),
])
def test_a_hub_source_needs_a_hub_id(values, message):
    with pytest.raises(HelmError) as e:
        template(*values)
    assert message in str(e.value), e.value


def test_the_fetch_command_links_the_model_dir_to_a_cached_snapshot(tmp_path):
    """The init container's own command and args, run here with the volume at tmp_path
    (offline, from a cache in the volume as huggingface_hub lays it out)."""
    [pt] = [p for p in model_pods(template(*CASE)) if p.where.endswith("verifier")]
    fetch = pt.spec["initContainers"][0]
    volume = tmp_path / "models"
    add_to_cache(volume / "hub", HUB_ID, DEMO_MODEL)
    args = [a.replace("/models", str(volume), 1) for a in fetch["args"]]
    command = [sys.executable if c == "python" else c for c in fetch["command"]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(volume / ".huggingface")}
    done = subprocess.run([*command, *args], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    link = volume / "mimo-7b-rl"
    assert link.is_symlink()
    assert (link / "config.json").read_bytes() == (DEMO_MODEL / "config.json").read_bytes()
