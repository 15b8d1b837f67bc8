"""`chainspec drain`: which members `--self` picks, and the arguments it refuses."""

from __future__ import annotations

import json

import pytest

from chainspec.cli import main
from chainspec.commands.drain import NODE_IP_ENV, node_ip, on_node

MEMBERS = [
    {"member_id": "drafter-0", "role": "drafter", "node": "10.0.0.1", "state": "ready"},
    {"member_id": "drafter-1", "role": "drafter", "node": "10.0.0.2", "state": "ready"},
    {"member_id": "verifier-0", "role": "verifier", "node": "10.0.0.1", "state": "ready"},
    {"member_id": "drafter-2", "role": "drafter", "node": "10.0.0.1", "state": "draining"},
    {"member_id": "gateway-0", "role": "gateway", "node": "10.0.0.1", "state": "ready"},
]


def test_self_picks_this_nodes_members_of_the_role() -> None:
    assert on_node(MEMBERS, "10.0.0.1", "drafter") == ["drafter-0"]
    assert on_node(MEMBERS, "10.0.0.1", None) == ["drafter-0", "verifier-0"]  # no gateway
    assert on_node(MEMBERS, "10.0.0.9", None) == []


def test_node_ip_comes_from_the_pod(monkeypatch) -> None:
    monkeypatch.setenv(NODE_IP_ENV, "10.1.2.3")
    assert node_ip() == "10.1.2.3"


@pytest.mark.parametrize("argv", [["drain"], ["drain", "drafter-0", "--self"]])
def test_names_or_self_exactly_one(argv, capsys) -> None:
    assert main([*argv, "--dry-run"]) == 2
    assert "name the members to drain, or give --self" in capsys.readouterr().err


def test_dry_run_prints_what_it_would_drain(capsys) -> None:
    assert main(["drain", "--self", "--role", "drafter", "--namespace", "ns", "--dry-run"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"command": "drain", "members": [], "self": True, "role": "drafter",
                   "address": None, "namespace": "ns"}
