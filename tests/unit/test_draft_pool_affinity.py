"""Prefix-affine routing in the verifier's draft pool (rpc/draft_affinity.py): a sequence
that opens from a prefix hit goes to the drafter its blocks were sent to, within a slack.
The served path (two real drafters, a hit, no resync) is in
tests/integration/test_draft_pool.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chainspec.engine.draft_types import SeqUpdate
from chainspec.rpc.draft_affinity import AFFINITY_KEYS, AFFINITY_SLACK, PrefixAffinity


@dataclass(eq=False)
class _Link:
    endpoint: str
    seqs: set = field(default_factory=set)


def _update(seq_id: int, start: int, keys) -> SeqUpdate:
    return SeqUpdate(seq_id, start, (5,), torch.zeros(1, 4), cache_keys=tuple(keys))


def test_a_hit_follows_its_blocks_unless_their_drafter_is_far_busier():
    affinity = PrefixAffinity()
    a, b = _Link("a"), _Link("b")
    affinity.sent(a.endpoint, _update(1, 0, [(16, b"k16"), (32, b"k32")]), opens=False)
    opens = _update(2, 32, [(16, b"k16"), (32, b"k32")])
    assert affinity.choose(opens, [b, a]) is a  # its last block's key went to a
    a.seqs = set(range(AFFINITY_SLACK))
    assert affinity.choose(opens, [b, a]) is a
    a.seqs = set(range(AFFINITY_SLACK + 1))
    assert affinity.choose(opens, [b, a]) is None  # least loaded decides
    b.seqs = set(range(40))
    a.seqs = set(range(50))  # a quarter of the least loaded's 40 is the slack now
    assert affinity.choose(opens, [b, a]) is a
    assert affinity.choose(_update(3, 0, [(16, b"k16")]), [b, a]) is None  # no hit
    assert affinity.choose(_update(4, 32, [(16, b"k16"), (32, b"new")]), [b, a]) is None


def test_only_blocks_an_update_makes_final_are_remembered():
    """The keys a hit opens from are the drafter's to read, and it may lack them (a miss):
    they do not move the blocks' owner. Keys past `start` are blocks it will cache."""
    affinity = PrefixAffinity()
    a, b = _Link("a"), _Link("b")
    affinity.sent(a.endpoint, _update(1, 0, [(16, b"k16")]), opens=False)
    affinity.sent(b.endpoint, _update(2, 16, [(16, b"k16"), (32, b"k32")]), opens=True)
    assert affinity.sent_to == {b"k16": "a", b"k32": "b"}
    # a later update of a sequence b holds: a block final now, though it ends at start
    affinity.sent(b.endpoint, _update(2, 48, [(48, b"k48")]), opens=False)
    assert affinity.sent_to[b"k48"] == "b"
    for i in range(AFFINITY_KEYS):
        affinity.sent(a.endpoint, _update(3, 0, [(16, i.to_bytes(4, "big"))]), opens=False)
    assert len(affinity.sent_to) == AFFINITY_KEYS and b"k16" not in affinity.sent_to
