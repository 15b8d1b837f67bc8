"""The drafter's tensor-parallel size (issue 22 item 3): `--drafter-tensor-parallel-size`
on `serve`/`up` (`-tp`/`--tensor-parallel-size` on a lone `chainspec drafter`) reaches
the drafter's engine options and only those; a size that does not divide the MTP layers'
heads is refused in one line before anything starts, and drafter mode local (which
drafts in each verifier's process at size 1) refuses it."""

from __future__ import annotations

import json

import pytest

from chainspec.cli import main
from chainspec.cluster.config import StackConfig
from chainspec.engine.local import DEMO_MODEL

DIVIDES_NOT = "its MTP layers: tensor-parallel size 3 does not divide the 4 attention heads"


@pytest.mark.parametrize("argv", [
    ["serve", "--dry-run", "--drafter-tensor-parallel-size", "3"],
    ["up", "--dry-run", "--drafter-tensor-parallel-size", "3"],
    ["drafter", "--dry-run", "-tp", "3"],
])
def test_a_size_that_does_not_divide_the_mtp_heads_is_one_line(argv, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and DIVIDES_NOT in err and str(DEMO_MODEL) in err


def test_serve_resolves_the_drafter_size_apart_from_the_verifier_size(capsys) -> None:
    assert main(["serve", "--dry-run", "-tp", "2", "--drafter-tensor-parallel-size", "2"]
                ) == 0
    stack = json.loads(capsys.readouterr().out)["config"]
    assert (stack["drafter"]["tensor_parallel_size"],
            stack["verifier"]["tensor_parallel_size"]) == (2, 2)
    assert main(["up", "--dry-run", "--drafter-tensor-parallel-size", "2"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["drafter"]["tensor_parallel_size"],
            config["verifier"]["tensor_parallel_size"]) == (2, 1)


def test_a_lone_drafter_takes_its_size(capsys) -> None:
    assert main(["drafter", "--dry-run", "--tensor-parallel-size", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["model"]["tensor_parallel_size"] == 2


def test_each_role_gets_its_own_size() -> None:
    config = StackConfig.from_dict({"drafter": {"tensor_parallel_size": 2}})
    assert config.local_options("drafter").tensor_parallel_size == 2
    assert config.local_options("verifier").tensor_parallel_size == 1


def test_drafter_mode_local_refuses_a_drafter_group(capsys) -> None:
    assert main(["serve", "--dry-run", "--drafter-mode", "local",
                 "--drafter-tensor-parallel-size", "2"]) == 2
    assert "drafter.tensor_parallel_size needs drafter.mode remote" in capsys.readouterr().err
