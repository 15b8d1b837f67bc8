"""values.schema.json (draft-07) refuses wrong types and unknown keys -- Helm checks it
in `helm template` and `helm lint` -- and the template refuses what a schema cannot say."""

import json

import pytest
import yaml

from tests.helm.render import HelmError, helm_run, template
from tests.tools import CHART


def schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def refused(*args: str) -> str:
    with pytest.raises(HelmError) as e:
        template(*args)
    return str(e.value)


def test_schema_is_draft_07_and_closed_at_the_top():
    s = schema()
    assert s["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert s["additionalProperties"] is False
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) == set(s["properties"])


def test_roles_share_one_block():
    """One shape for both roles, but for the drafter's `mode` (where drafting runs; the
    template refuses `verifier.mode`, tests/helm/test_drafter_mode.py) and `autoscale`
    (the controller's drafter autoscaler; the verifier's schema refuses it)."""
    s, values = schema(), yaml.safe_load((CHART / "values.yaml").read_text())
    role = {"$ref": "#/definitions/role"}
    assert s["properties"]["drafter"] == role
    verifier = s["properties"]["verifier"]["allOf"]
    assert verifier[0] == role and verifier[1]["properties"] == {"autoscale": False}
    assert s["definitions"]["role"]["additionalProperties"] is False
    drafter = {k: v for k, v in values["drafter"].items() if k not in ("mode", "autoscale")}
    assert _shape(drafter) == _shape(values["verifier"])


def _shape(value):
    return {k: _shape(v) for k, v in value.items()} if isinstance(value, dict) else None


def test_wrong_type_is_refused():
    assert "drafter.replicas" in refused("--set", "drafter.replicas=two")
    assert "Invalid type" in refused("--set-json", 'verifier.resources="8 GPUs"')


def test_unknown_keys_are_refused():
    assert "Additional property replica is not allowed" in refused("--set", "replica=3")
    assert "Additional property replica is not allowed" in refused("--set", "drafter.replica=3")


def test_lint_fails_on_bad_values(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("drafter:\n  replicas: lots\nunknownTopLevel: 1\n")
    done = helm_run("lint", "--strict", str(CHART), "-f", str(bad))
    assert done.returncode != 0
    assert "unknownTopLevel" in done.stdout + done.stderr


def test_replicas_outside_min_max_are_refused():
    assert "minReplicas <= replicas <= maxReplicas" in refused("--set", "drafter.replicas=9")
    autoscaled = ("--set", "drafter.autoscaling=true")
    assert "minReplicas <= maxReplicas" in refused(*autoscaled, "--set", "drafter.minReplicas=9")
    template(*autoscaled, "--set", "drafter.replicas=9")  # ignored under the autoscaler


def test_model_source_needs_its_location():
    assert "model.pvc.claimName is required" in refused("--set", "model.source=pvc")
