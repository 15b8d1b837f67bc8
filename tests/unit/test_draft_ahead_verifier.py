"""Draft-ahead on the verifier (DESIGN 4.8) with tiny random models: output stays exactly
plain (greedy) whatever the look-aheads guess. Their drafts are poor, so nearly every
look-ahead misses here; the hit path is tested on the demo model
(tests/demo/test_draft_ahead_demo.py)."""

from __future__ import annotations

import pytest

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
