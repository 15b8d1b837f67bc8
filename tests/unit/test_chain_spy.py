"""Chain is real: each module receives the hidden state the design says it should."""

from __future__ import annotations

import random

import pytest
import torch

from chainspec.engine.draft_types import SeqUpdate
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.models.mtp import MTPModule
from tests.unit.tiny_models import tiny_draft_model

HIDDEN = 32


class Spy:
    """Records, per module call, the hidden input and the block output."""

    def __init__(self, model) -> None:
        self.calls: list[tuple[MTPModule, torch.Tensor, torch.Tensor]] = []
        self.handles = [m.register_forward_hook(self._hook) for m in model.mtp]

    def _hook(self, module, args, output) -> None:
        token_emb, hidden, *_ = args
        self.calls.append((module, hidden.clone(), output.clone()))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def one_round(chain: bool, k: int = 3, modules: int = 3, hidden: torch.Tensor | None = None,
              seed: int = 0):
    model = tiny_draft_model(modules, seed=1)
    engine = DrafterEngine(model, DrafterConfig(num_steps=k, chain=chain, max_seqs=2,
                                                max_len=64))
    rng = random.Random(seed)
    tokens = tuple(rng.randrange(61) for _ in range(6))
    h = hidden if hidden is not None else torch.randn(6, HIDDEN,
                                                      generator=torch.Generator().manual_seed(9))
    spy = Spy(model)
    out = engine.update([SeqUpdate(0, 0, tokens, h)])[0]
    spy.close()
    return model, spy.calls, out, h


@pytest.mark.parametrize("chain", [True, False])
def test_each_step_receives_the_designed_hidden_state(chain: bool) -> None:
    model, calls, _, h = one_round(chain, k=3, modules=3)
    assert len(calls) == 3
    for step, (module, received, _) in enumerate(calls, start=1):
        assert module is model.module_for_step(step)
        if step == 1 or not chain:
            expected = h  # g[0] = h, the target's hidden states of the window rows
        else:
            expected = calls[step - 2][2]  # module k-1's block output, same round
        torch.testing.assert_close(received, expected, rtol=0, atol=0)


def test_reused_module_still_chains() -> None:
    """L=1 module serving K=3 steps: step k reads step k-1's output, not its own input."""
    model, calls, _, h = one_round(True, k=3, modules=1)
    assert all(c[0] is model.mtp[0] for c in calls)
    torch.testing.assert_close(calls[1][1], calls[0][2], rtol=0, atol=0)
    torch.testing.assert_close(calls[2][1], calls[1][2], rtol=0, atol=0)
    assert not torch.equal(calls[2][1], h)


def test_perturbing_target_hidden_changes_step_one_drafts() -> None:
    changed = 0
    for seed in range(5):
        _, _, base, h = one_round(True, seed=seed)
        _, _, moved, _ = one_round(True, hidden=h + 3.0 * torch.randn_like(h), seed=seed)
        changed += base.tokens[0] != moved.tokens[0]
    assert changed >= 3


def test_toggling_chain_changes_later_drafts_but_not_the_first() -> None:
    differ = 0
    for seed in range(6):
        _, _, chained, _ = one_round(True, seed=seed)
        _, _, flat, _ = one_round(False, seed=seed)
        assert chained.tokens[0] == flat.tokens[0]  # step 1 reads h in both modes
        differ += not torch.equal(chained.tokens[1:], flat.tokens[1:])
    assert differ >= 3
