"""A bad model is one line and exit 2 from `serve` and `up`, before Ray starts and with
`--dry-run` too: a missing directory, an unsupported architecture, a missing or
mis-shaped target or MTP tensor. A config that declares MTP layers whose tensors were
dropped serves plainly with a warning (DESIGN 2.4)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from safetensors.torch import load_file, save_file

from tests.integration.tiny_checkpoint import write_tiny_model

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("good"))


def _edit(src, dst, file: str, change) -> str:
    shutil.copytree(src, dst)
    tensors = load_file(dst / file)
    change(tensors)
    save_file(tensors, dst / file)
    return str(dst)


def _unknown_arch(src, dst) -> str:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["FooBarForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def _first(tensors, part: str) -> str:
    return next(n for n in sorted(tensors) if part in n)


CASES = {
    "missing directory": (lambda src, dst: str(dst / "nowhere"), "no such model directory"),
    "unknown architecture": (_unknown_arch, "unknown architecture 'FooBarForCausalLM'"),
    "mis-shaped MTP tensor": (lambda src, dst: _edit(
        src, dst, "mtp.safetensors", lambda t: t.__setitem__(
            _first(t, "eh_proj"), t[_first(t, "eh_proj")][:, :-1].contiguous())),
        "eh_proj.weight has shape"),
    "missing MTP tensor": (lambda src, dst: _edit(
        src, dst, "mtp.safetensors", lambda t: t.pop(_first(t, "hnorm"))),
        "missing tensor model.layers.2.hnorm.weight"),
    "missing target tensor": (lambda src, dst: _edit(
        src, dst, "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        "missing tensor model.layers.1.mlp.up_proj.weight"),
}


def _chainspec(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chainspec.cli", *args], capture_output=True,
                          text=True, timeout=90, env={"RAY_AUTH_MODE": "disabled",
                                                      "PATH": "/usr/bin:/bin"})


COMMANDS = ("serve", "up")


@pytest.fixture(scope="module")
def runs(good, tmp_path_factory) -> dict[tuple[str, str], subprocess.CompletedProcess]:
    """Every (case, command) run, two processes at a time: each is a fresh Python that
    spends its ~2 s importing, one core each (CI has two)."""
    models = {case: make(good, tmp_path_factory.mktemp("model") / "model")
              for case, (make, _) in CASES.items()}
    keys = [(case, command) for case in CASES for command in COMMANDS]
    with ThreadPoolExecutor(2) as pool:
        done = pool.map(lambda k: _chainspec(k[1], "--model", models[k[0]], "--dry-run"),
                        keys)
        return dict(zip(keys, done, strict=True))


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_model_is_one_line_before_anything_starts(runs, case, command):
    _, message = CASES[case]
    run = runs[case, command]
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], run.stderr
    assert "Traceback" not in run.stderr


def test_declared_but_dropped_mtp_layers_serve_plainly(good, tmp_path):
    model = tmp_path / "dropped"
    shutil.copytree(good, model)
    (model / "mtp.safetensors").unlink()  # quantized releases often drop them
    run = _chainspec("serve", "--model", str(model), "--dry-run")
    assert run.returncode == 0, run.stderr
    assert "holds none of their weights" in run.stderr and "plain decoding" in run.stderr
    assert json.loads(run.stdout)["config"]["drafter"]["replicas"] == 0
