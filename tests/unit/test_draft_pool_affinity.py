"""Prefix-affine routing in the verifier's draft pool (rpc/draft_pool.py): a sequence that
opens from a prefix hit goes to the drafter its blocks were sent to, within a load slack.
The served path (two real drafters, a hit, no resync) is in
tests/integration/test_draft_pool.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from chainspec.engine.draft_types import SeqUpdate
from chainspec.rpc.draft_pool import AFFINITY_KEYS, AFFINITY_SLACK, GrpcDraftClient


@dataclass(eq=False)
class _Link:
    endpoint: str
    seqs: set = field(default_factory=set)


def _update(seq_id: int, start: int, keys) -> SeqUpdate:
    return SeqUpdate(seq_id, start, (5,), torch.zeros(1, 4), cache_keys=tuple(keys))


def test_a_hit_follows_its_blocks_unless_their_drafter_is_far_busier():
    client = GrpcDraftClient()
    a, b = _Link("a"), _Link("b")
    client._keys_sent(a, _update(1, 0, [(16, b"k16"), (32, b"k32")]), opens=False)
    opens = _update(2, 32, [(16, b"k16"), (32, b"k32")])
    assert client._affine(opens, [b, a]) is a  # its last block's key went to a
    a.seqs = set(range(AFFINITY_SLACK))
    assert client._affine(opens, [b, a]) is a
    a.seqs = set(range(AFFINITY_SLACK + 1))
    assert client._affine(opens, [b, a]) is None  # least loaded decides
    b.seqs = set(range(40))
    a.seqs = set(range(50))  # a quarter of the least loaded's 40 is the slack now
    assert client._affine(opens, [b, a]) is a
    assert client._affine(_update(3, 0, [(16, b"k16")]), [b, a]) is None  # no hit
    assert client._affine(_update(4, 32, [(16, b"k16"), (32, b"new")]), [b, a]) is None


def test_only_blocks_an_update_makes_final_are_remembered():
    """The keys a hit opens from are the drafter's to read, and it may lack them (a miss):
    they do not move the blocks' owner. Keys past `start` are blocks it will cache."""
    client = GrpcDraftClient()
    a, b = _Link("a"), _Link("b")
    client._keys_sent(a, _update(1, 0, [(16, b"k16")]), opens=False)
    client._keys_sent(b, _update(2, 16, [(16, b"k16"), (32, b"k32")]), opens=True)
    assert client._key_sent_to == {b"k16": "a", b"k32": "b"}
    # a later update of a sequence b holds: a block final now, though it ends at start
    client._keys_sent(b, _update(2, 48, [(48, b"k48")]), opens=False)
    assert client._key_sent_to[b"k48"] == "b"
    for i in range(AFFINITY_KEYS):
        client._keys_sent(a, _update(3, 0, [(16, i.to_bytes(4, "big"))]), opens=False)
    assert len(client._key_sent_to) == AFFINITY_KEYS and b"k16" not in client._key_sent_to
