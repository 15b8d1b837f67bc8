"""Quantized hidden states on the wire (int8, fp8 e4m3 with per-row scales) cost the
drafts a little precision and the output nothing: over real gRPC the verifier's output
equals plain decoding, and drafts still get accepted."""

from __future__ import annotations

import copy

import pytest

from chainspec.rpc.draft_pool import GrpcDraftClient
from tests.integration.grpc_helpers import drafter_engine, start_drafter
from tests.unit.engine_fixtures import engine, outputs, prompts

pytestmark = pytest.mark.timeout(120)
K, MAX_TOKENS = 3, 24


@pytest.mark.parametrize("wire", ["int8", "fp8_e4m3"])
def test_quantized_hidden_is_lossless(models, loop, wire: str) -> None:
    target, draft = models
    batch = prompts(8, vocab=target.config.vocab_size, seed=11)
    plain = outputs(engine(target), batch, MAX_TOKENS)[0]
    server = start_drafter(loop, drafter_engine(copy.deepcopy(draft), k=K))
    client = GrpcDraftClient([server.address], round_deadline_s=10.0, hidden_dtype=wire)
    try:
        got, result = outputs(engine(target, client=client, k=K), batch, MAX_TOKENS)
    finally:
        client.close()
        loop.run(server.stop(0))
    assert got == plain
    assert sum(c.stats.accepted_tokens for c in result.completions) > 0
