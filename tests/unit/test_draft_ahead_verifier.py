"""Draft-ahead on the verifier (DESIGN 4.8) with tiny random models: output stays exactly
plain (greedy) whatever the look-aheads guess. Their drafts are poor, so nearly every
look-ahead misses here; the hit path is tested on the demo model
(tests/demo/test_draft_ahead_demo.py)."""

from __future__ import annotations

import pytest

from chainspec.engine.request import StopConditions
from chainspec.engine.sampling import SamplingParams
from tests.unit.engine_fixtures import engine, outputs, prompts, tied_pair


@pytest.fixture(scope="module")
def pair():
    return tied_pair()


@pytest.fixture(scope="module")
def plain(pair):
    target, _ = pair
    return {n: outputs(engine(target), prompts(n, seed=n), 24)[0] for n in (1, 3, 8)}


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("chain", [True, False])
def test_greedy_output_equals_plain_with_draft_ahead(pair, plain, batch, k, chain) -> None:
    target, draft = pair
    eng = engine(target, draft, k=k, chain=chain, draft_ahead=True)
    got, result = outputs(eng, prompts(batch, seed=batch), 24)
    assert got == plain[batch]
    if k == 1:  # nothing to look ahead with: one draft is all a round has
        assert eng.ahead_hits == eng.ahead_misses == 0
    else:
        assert eng.ahead_hits + eng.ahead_misses > 0


class AskingClient:
    """A draft client that records every update's depth ask, then passes it on."""

    def __init__(self, inner) -> None:
        self.inner, self.asks = inner, []

    def submit(self, updates) -> None:
        self.asks += [u.num_drafts for u in updates]
        self.inner.submit(updates)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("draft_ahead", [False, True])
def test_draft_ahead_always_asks_for_every_draft_step(pair, plain, draft_ahead) -> None:
    """Drafter-side depth (4.11) would leave steps behind that a look-ahead's hypotheses
    build on: with draft-ahead on, every update (the prompt's last chunk too: it has a
    verdict) asks for K (0), even when the request's cap is fewer; without it, the cap
    is asked for."""
    target, draft = pair
    k = 3
    eng = engine(target, draft, k=k, draft_ahead=draft_ahead)
    eng.drafter = client = AskingClient(eng.drafter)
    for i, prompt in enumerate(prompts(3, seed=3)):
        eng.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0),
                        StopConditions(max_tokens=24), num_speculative_tokens=1)
    while eng.has_work:
        eng.step()
    assert client.asks and set(client.asks) == ({0} if draft_ahead else {1})
