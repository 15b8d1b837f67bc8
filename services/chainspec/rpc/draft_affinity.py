"""Prefix-affine routing for the verifier's draft pool (DESIGN 4.12, `draft_pool.py`).

Each drafter caches only the MTP KV blocks it computed, so a sequence that opens from a
verifier prefix hit should go to the drafter its blocks were sent to; sent elsewhere, it
is a miss there, a resync and a dense recompute of the whole prefix. `PrefixAffinity`
remembers where each drafter cache key went and picks that drafter for an opening
update, unless it holds far more sequences than the least loaded one."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from chainspec.engine.draft_types import SeqUpdate

AFFINITY_KEYS = 32768  # drafter cache keys remembered with the drafter they were sent to
AFFINITY_SLACK = 4  # a hit goes to its drafter unless that holds this many (or a quarter)
# more sequences than the least loaded one


class Drafter(Protocol):
    endpoint: str
    seqs: set


class PrefixAffinity:
    """Cache key -> the endpoint it was last sent to (the last AFFINITY_KEYS keys)."""

    def __init__(self) -> None:
        self.sent_to: OrderedDict[bytes, str] = OrderedDict()

    def sent(self, endpoint: str, u: SeqUpdate, opens: bool) -> None:
        """Remember where the blocks `u` makes final go. NOTE: not the keys a hit opens
        the sequence from (`opens`, end <= start): the drafter reads those, and may lack
        them (a miss)."""
        for end, key in u.cache_keys:
            if end > u.start or not opens:
                self.sent_to[key] = endpoint
                self.sent_to.move_to_end(key)
        while len(self.sent_to) > AFFINITY_KEYS:
            self.sent_to.popitem(last=False)

    def choose(self, u: SeqUpdate, live: Sequence[Drafter]) -> Drafter | None:
        """The live drafter that was sent the cache key `u` opens from, unless it holds
        far more sequences than the least loaded one; None: least loaded decides."""
        if not u.opens_from_cache or not live:
            return None
        key = next(key for end, key in u.cache_keys if end == u.start)
        endpoint = self.sent_to.get(key)
        link = next((link for link in live if link.endpoint == endpoint), None)
        least = min(len(other.seqs) for other in live)
        if link is None or len(link.seqs) > least + max(AFFINITY_SLACK, least // 4):
            return None
        return link
