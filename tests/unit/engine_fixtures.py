"""Tiny target + drafter pairs wired into verifier engines, for engine tests."""

from __future__ import annotations

import random
from collections.abc import Sequence

from chainspec.engine.draft_client import LocalDraftClient
from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.engine.kv_budget import KVBudget
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.schedule import WorkKind
from chainspec.engine.verifier import VerifierConfig, VerifierEngine
from tests.unit.tiny_models import tiny_draft_model, tiny_target

ROOMY = KVBudget()  # as many blocks as fixed slots would take


def tied_pair(vocab: int = 61, modules: int = 2, seed: int = 0):
    """A tiny target and an MTP draft model sharing its embedding and head."""
    target = tiny_target(seed=seed, vocab=vocab)
    draft = tiny_draft_model(modules, seed=seed + 1, vocab=vocab)
    draft.embed_tokens.weight = target.model.embed_tokens.weight
    draft.lm_head.weight = target.lm_head.weight
    return target, draft


def engine(target, draft=None, k: int = 3, chain: bool = True, max_seqs: int = 8,
           chunk: int = 512, client=None, top_k: int = 4, sampled_drafts: bool = True,
           eos_ids: Sequence[int] = (), detokenize=None, groups: int = 1,
           draft_ahead: bool = False, kv: KVBudget = ROOMY,
           drafter_kv: KVBudget = ROOMY) -> VerifierEngine:
    if client is None and draft is not None:
        client = LocalDraftClient(DrafterEngine(draft, DrafterConfig(
            num_steps=k, chain=chain, max_seqs=max_seqs, max_len=256, top_k=top_k,
            kv=drafter_kv)))
    cfg = VerifierConfig(num_steps=k, max_seqs=max_seqs, max_len=256, prefill_chunk=chunk,
                         max_batch_tokens=max(64, max_seqs * (k + 1)),
                         sampled_drafts=sampled_drafts, groups=groups,
                         draft_ahead=draft_ahead, kv=kv)
    return VerifierEngine(target, cfg, client, eos_ids, detokenize)


def prompts(n: int, vocab: int = 61, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(2, 24))] for _ in range(n)]


def outputs(eng: VerifierEngine, batch: Sequence[Sequence[int]], max_tokens: int = 20,
            temperature: float = 0.0, seeds: Sequence[int] | None = None):
    params = [SamplingParams(temperature=temperature, seed=s)
              for s in (seeds or range(len(batch)))]
    result = run_to_completion(eng, batch, params, StopConditions(max_tokens=max_tokens))
    return [c.tokens for c in result.completions], result


class PrefillRows:
    """An engine observer that counts the prefill rows the target computes per request."""

    def __init__(self) -> None:
        self.prefill: dict[str, int] = {}

    def request_added(self, request_id, prompt_len, arrival_s) -> None:
        self.prefill[request_id] = 0

    def step_done(self, step) -> None:
        for w in step.work:
            if w.kind is WorkKind.PREFILL:
                self.prefill[w.request.request_id] += w.num_rows


def run_greedy(eng: VerifierEngine, rid: str, prompt: list[int], max_tokens: int) -> list[int]:
    """One greedy request through `eng` to its end: the tokens it generated."""
    eng.add_request(rid, prompt, SamplingParams(temperature=0.0),
                    StopConditions(max_tokens=max_tokens))
    got = []
    while eng.has_work:
        for out in eng.step():
            got.extend(out.new_tokens)
    return got


class RandomDepth:
    """A stand-in policy choosing k uniformly in 0..cap, and the drafter's depth for the
    next round (`ask`, 0 = K) uniformly too: output must not depend on either."""

    plain_steps = 0  # new prompts ask for drafts
    ask = 0

    def __init__(self, seed: int, num_steps: int = 0) -> None:
        self.rng = random.Random(seed)
        self.chosen: list[int] = []
        self.num_steps = num_steps
        self.rounds: list[int] = []  # the draft steps each drafting step asked for

    def depths(self, keys, caps, other_rows=0, demand=0):
        out = [self.rng.randint(0, cap) for cap in caps]
        self.chosen += out
        self.ask = self.rng.randint(0, self.num_steps)
        return out

    def observe_round(self, key, num_drafts, accepted):
        pass

    def observe_step(self, *args, **kwargs):
        if args[-1]:
            self.rounds.append(args[-1])

    def forget(self, key):
        pass
