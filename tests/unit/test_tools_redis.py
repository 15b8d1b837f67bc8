"""The redis-server finder follows the skip-or-fail rule, and deploy/install-redis.sh has
nothing to do when redis-server is there (and never calls apt then)."""

import os
import shutil
import subprocess

import pytest

from tests import tools

SCRIPT = tools.REPO / "deploy" / "install-redis.sh"


def test_missing_redis_server_skips_or_fails(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv(tools.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="make tools"):
        tools.redis_server()
    monkeypatch.setenv(tools.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="CHAINSPEC_REQUIRE_TOOLS=1"):
        tools.redis_server()


def run_script(tmp_path, *names: str) -> tuple[subprocess.CompletedProcess, object]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in names:
        (bin_dir / name).write_text("#!/bin/sh\necho called >> \"$0.log\"\n")
        (bin_dir / name).chmod(0o755)
    r = subprocess.run([shutil.which("bash"), str(SCRIPT)], capture_output=True, text=True,
                       env={**os.environ, "PATH": str(bin_dir)}, timeout=60)
    return r, bin_dir


def test_install_script_does_nothing_when_redis_is_there(tmp_path):
    r, bin_dir = run_script(tmp_path, "redis-server", "apt-get")
    assert r.returncode == 0 and "already on PATH" in r.stdout, r.stderr
    assert not (bin_dir / "apt-get.log").exists()


def test_install_script_without_apt_says_what_to_install(tmp_path):
    r, _ = run_script(tmp_path)
    assert r.returncode == 0 and "no apt-get" in r.stderr, r.stderr
