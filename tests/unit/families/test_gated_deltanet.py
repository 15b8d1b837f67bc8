"""The chunked gated delta rule (prefill spans) equals the row form (the oracle), from a
non-zero state, across chunk boundaries, with decays strong enough to underflow exp()."""

from __future__ import annotations

import pytest
import torch

from chainspec.models.gated_deltanet import delta_rule_chunked, l2norm


def rows(q, k, v, log_decay, beta, state):
    out = []
    for t in range(q.shape[0]):
        state = state * log_decay[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hkv,hk->hv", state, k[t])) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", state, q[t]))
    return torch.stack(out), state


@pytest.mark.parametrize("n,chunk,strength", [(37, 16, 1.0), (16, 16, 1.0), (5, 4, 1.0),
                                              (40, 8, 200.0)])
def test_chunked_equals_rows(n, chunk, strength):
    gen = torch.Generator().manual_seed(n)
    h, dk, dv = 3, 8, 6
    q = l2norm(torch.randn(n, h, dk, generator=gen)) * dk ** -0.5
    k = l2norm(torch.randn(n, h, dk, generator=gen))
    v = torch.randn(n, h, dv, generator=gen)
    log_decay = -strength * torch.rand(n, h, generator=gen)  # 200: e^-200 underflows
    beta = torch.rand(n, h, generator=gen)
    state = torch.randn(h, dk, dv, generator=gen)
    want_out, want_state = rows(q, k, v, log_decay, beta, state)
    got_out, got_state = delta_rule_chunked(q, k, v, log_decay, beta, state, chunk)
    assert torch.isfinite(got_out).all()
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=1e-5, rtol=1e-5)
