"""The image and the chart agree (Ray version, non-root user), and the chart's copies of
deploy/'s monitoring files are those files."""

import re

import pytest
import yaml

from tests.tools import CHART, REPO

DOCKERFILE = REPO / "deploy" / "Dockerfile"
# deploy/ file -> the chart's copy (Helm reads files inside the chart only)
COPIES = {"prometheus/rules.yaml": "files/prometheus-rules.yaml",
          "grafana/chainspec.json": "files/grafana-dashboard.json"}


def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def test_image_base_is_rays_official_image_of_the_charts_ray_version():
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    assert base == f"rayproject/ray:{values()['rayVersion']}-py311-gpu"
    assert f"rayproject/ray:{values()['rayVersion']}-py311 " in text  # the CPU build


def test_image_runs_as_the_charts_non_root_user():
    user = re.findall(r"^USER (\S+)$", DOCKERFILE.read_text(), re.M)
    uid, gid = user[-1].split(":")
    assert uid != "0" and uid != "root"
    for block in ("head", "verifier", "drafter", "gateway"):
        ctx = values()[block]["podSecurityContext"]
        assert ctx["runAsNonRoot"] is True
        assert (str(ctx["runAsUser"]), str(ctx["runAsGroup"])) == (uid, gid), block


@pytest.mark.parametrize("name", sorted(COPIES))
def test_chart_monitoring_files_are_deploys(name):
    copy = (CHART / COPIES[name]).read_text()
    source = (REPO / "deploy" / name).read_text()
    assert copy == source, f"copy deploy/{name} to helm/chainspec/{COPIES[name]}"
