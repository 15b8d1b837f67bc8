"""The tool finder skips for a missing tool, and fails instead under
CHAINSPEC_REQUIRE_TOOLS=1, so CI cannot go green by skipping the chart tests."""

import pytest

from tests import tools


def test_missing_tool_skips_by_default(monkeypatch):
    monkeypatch.delenv(tools.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="helm is missing: run make tools"):
        tools.missing("helm", "run make tools")


def test_missing_tool_fails_when_tools_are_required(monkeypatch):
    monkeypatch.setenv(tools.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="CHAINSPEC_REQUIRE_TOOLS=1"):
        tools.missing("helm", "run make tools")


def test_missing_crd_folder_fails_when_tools_are_required(monkeypatch, tmp_path):
    monkeypatch.setenv(tools.REQUIRE_ENV, "1")
    monkeypatch.setattr(tools, "CRD_DIR", tmp_path / "absent")
    with pytest.raises(pytest.fail.Exception, match="CRD schemas folder"):
        tools.crd_dir()


def test_helm_found_is_helm_3():
    assert tools._is_helm3(tools.helm())
