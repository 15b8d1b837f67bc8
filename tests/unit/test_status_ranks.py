"""`chainspec status` shows every rank of a TP member (issue 22 item 5): the JSON carries
the member's `ranks` as the controller's view has them, and the table a line per rank
under its member (none for a TP=1 member)."""

from __future__ import annotations

import json

from chainspec.cluster.membership import Member
from chainspec.commands.stack_args import print_members


def _members() -> list[dict]:
    tp = Member("verifier-0", "verifier", pid=11, node="10.0.0.1")
    tp.observe({"pid": 11, "node": "10.0.0.1", "load": 0, "endpoint": "10.0.0.1:5000",
                "error": None, "serving": True,
                "ranks": [{"rank": 0, "pid": 11, "node": "10.0.0.1", "state": "alive"},
                          {"rank": 1, "pid": 12, "node": "10.0.0.1", "state": "dead"}]})
    plain = Member("verifier-1", "verifier")
    plain.observe({"pid": 21, "node": "10.0.0.1", "load": 0, "endpoint": "10.0.0.1:5001",
                   "error": None, "serving": True})
    return [tp.to_dict(), plain.to_dict()]


def test_json_shows_each_rank(capsys) -> None:
    print_members(_members(), as_json=True)
    members = json.loads(capsys.readouterr().out)["members"]
    assert [r["pid"] for r in members[0]["ranks"]] == [11, 12]
    assert members[0]["ranks"][1]["state"] == "dead" and members[1]["ranks"] is None


def test_table_has_a_line_per_rank_under_its_member(capsys) -> None:
    print_members(_members(), as_json=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("verifier-0")
    assert lines[2:4] == ["  rank 0: alive, pid 11, node 10.0.0.1",
                          "  rank 1: dead, pid 12, node 10.0.0.1"]
    assert lines[4].startswith("verifier-1") and len(lines) == 5
