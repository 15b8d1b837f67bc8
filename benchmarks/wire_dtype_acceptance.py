"""Acceptance cost of quantizing hidden states on the wire (f32 / bf16 / int8 / fp8).

The verifier's updates go through the real codec (encode_tensor -> decode_tensor) before
the drafter sees them, exactly as over gRPC; output stays lossless (the verifier decides
every token), so only acceptance can move. Greedy, K = 3, held-out prompts of the demo
model. Usage: python benchmarks/wire_dtype_acceptance.py [--prompts 20] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from chainspec.bench import load_prompts
from chainspec.engine.draft_client import LocalDraftClient
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.local import DEMO_MODEL, LocalOptions, build_verifier, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import merged_stats, run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.codec import decode_tensor, encode_tensor

WIRE_DTYPES = ("f32", "bf16", "int8", "fp8_e4m3")


class WireClient(LocalDraftClient):
    """An in-process drafter whose hidden rows make a codec round trip first."""

    def __init__(self, engine: DrafterEngine, wire_dtype: str) -> None:
        super().__init__(engine)
        self.wire_dtype = wire_dtype

    def submit(self, updates) -> None:
        super().submit([dataclasses.replace(
            u, hidden=decode_tensor(encode_tensor(u.hidden, self.wire_dtype)))
            for u in updates])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    opts = LocalOptions(DEMO_MODEL, num_steps=3, max_seqs=8, max_len=512)
    models = load_models(opts, speculative=True)
    tok = Tokenizer.from_dir(DEMO_MODEL)
    prompts = [tok.encode(t) for t in load_prompts(DEMO_MODEL, args.prompts)]
    stop = StopConditions(max_tokens=args.max_tokens, ignore_eos=True)
    plain = run_to_completion(build_verifier(models, opts, False), prompts,
                              SamplingParams(temperature=0.0), stop)
    rows = []
    for wire in WIRE_DTYPES:
        eng = build_verifier(models, opts, False)
        eng.drafter = WireClient(DrafterEngine(models.draft, DrafterConfig(
            num_steps=3, max_seqs=8, max_len=512)), wire)
        result = run_to_completion(eng, prompts, SamplingParams(temperature=0.0), stop)
        s = merged_stats(result.completions, 3)
        rows.append({"wire_dtype": wire, "acceptance_length": round(s.acceptance_length, 4),
                     "accepted_per_position": [round(a / s.rounds, 4)
                                               for a in s.accepted_per_pos],
                     "lossless": [c.tokens for c in result.completions]
                     == [c.tokens for c in plain.completions]})
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
