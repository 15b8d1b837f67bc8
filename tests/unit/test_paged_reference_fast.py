"""The paged-attention torch reference (matmul form, GQA folded into rows) equals SDPA over
each sequence's keys, for mixed prefill/verify rows through scattered block tables."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chainspec.kernels.paged_attention import paged_attention_reference

SPANS = [
    [(0, 0, 7), (1, 30, 4), (2, 13, 1)],  # prefill chunk, verify window, decode row
    [(0, 0, 6), (1, 5, 3)],  # in order, the second shorter: its group has padding rows
    [(0, 700, 4), (1, 3, 4), (2, 40, 1)],  # a long sequence in a batch of its own
]


@pytest.mark.parametrize("spans", SPANS)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 4), (8, 1)])
def test_reference_equals_sdpa_per_sequence(hq: int, hkv: int, spans) -> None:
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    bs, d, blocks, width = 4, 8, 600, 180
    kc, vc = torch.randn(2, blocks, bs, hkv, d, generator=gen)
    tables = torch.randperm(blocks, generator=gen)[:3 * width].view(3, width).to(torch.int32)
    pad = [-1] if len(spans) == 3 else []  # (sequence, first position, rows); padding row
    row_seq = torch.tensor([s for s, _, n in spans for _ in range(n)] + pad)
    positions = torch.tensor([p for _, p0, n in spans for p in range(p0, p0 + n)] + [0] * len(pad))
    q = torch.randn(len(row_seq), hq, d, generator=gen)
    out = paged_attention_reference(q, kc, vc, tables, row_seq, positions, 0.3)
    for s, p0, n in spans:
        rows = (row_seq == s).nonzero().squeeze(1)
        flat = [t[tables[s].long()].flatten(0, 1)[: p0 + n] for t in (kc, vc)]  # [L, Hkv, D]
        mask = torch.arange(p0 + n)[None, :] <= positions[rows][:, None]
        want = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), flat[0].transpose(0, 1), flat[1].transpose(0, 1),
            attn_mask=mask, scale=0.3, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5)
    if pad:
        assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # padding row
