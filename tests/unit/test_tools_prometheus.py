"""The Prometheus tool finders follow the skip-or-fail rule, and
deploy/install-prometheus.sh has nothing to do when the tools are there."""

import os
import shutil
import subprocess

import pytest

from tests import tools

SCRIPT = tools.REPO / "deploy" / "install-prometheus.sh"


@pytest.mark.parametrize("finder", [tools.promtool, tools.prometheus])
def test_missing_prometheus_tool_skips_or_fails(monkeypatch, finder):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv(tools.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="make tools"):
        finder()
    monkeypatch.setenv(tools.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="CHAINSPEC_REQUIRE_TOOLS=1"):
        finder()


def fake_bin(tmp_path, *names: str):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in names:
        path = bin_dir / name
        path.write_text("#!/bin/sh\necho called >> \"$0.log\"\n")
        path.chmod(0o755)
    return bin_dir


def run_script(path: str) -> subprocess.CompletedProcess:
    bash = shutil.which("bash")
    return subprocess.run([bash, str(SCRIPT)], capture_output=True, text=True,
                          env={**os.environ, "PATH": path}, timeout=60)


def test_install_script_does_nothing_when_the_tools_are_there(tmp_path):
    bin_dir = fake_bin(tmp_path, "promtool", "prometheus", "apt-get")
    r = run_script(f"{bin_dir}:/usr/bin:/bin")
    assert r.returncode == 0 and "already on PATH" in r.stdout, r.stderr
    assert not (bin_dir / "apt-get.log").exists()  # apt was never called


def test_install_script_without_apt_says_what_to_install(tmp_path):
    r = run_script(str(fake_bin(tmp_path)))  # neither the tools nor apt-get on PATH
    assert r.returncode == 0 and "no apt-get" in r.stderr, r.stderr


def test_promtool_is_found():
    assert os.access(tools.promtool(), os.X_OK)
