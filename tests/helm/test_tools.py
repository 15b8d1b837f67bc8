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


def test_missing_vendored_crds_fail_even_without_required_tools(monkeypatch, tmp_path):
    monkeypatch.delenv(tools.REQUIRE_ENV, raising=False)
    monkeypatch.setattr(tools, "CRD_DIR", tmp_path / "absent")
    with pytest.raises(pytest.fail.Exception, match="vendored CRD schemas are missing"):
        tools.crd_dir()


def test_the_vendored_crds_are_the_documented_upstream_versions():
    readme = (tools.CRD_DIR / "README.md").read_text()
    for name in sorted(p.name for p in tools.CRD_DIR.glob("*.yaml")):
        row = next((line for line in readme.splitlines() if line.startswith(f"| {name} ")),
                   None)
        assert row is not None, f"{name} has no source row in the README"
        assert "| v" in row and "Apache-2.0" in row


def test_helm_found_is_helm_3():
    assert tools._is_helm3(tools.helm())
