"""`n` > 1: one verifier request per choice, opened together and read interleaved.

Every choice names the client request as its `parent_request_id`, so the verifier counts
the n sequences as one request's for fair admission (engine/admission.py).

Choice i is its own Generate call with request id `<id>-<i>` and, when the client gave a
seed, seed `(seed + i) mod 2**64` (vLLM's derivation for parallel sampling), so choice 0
equals the n = 1 answer with the same seed and the n choices are reproducible. Without a
seed each call draws its own. Usage counts the prompt once and every choice's tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from chainspec.gateway.client import GenerationSpec, GenerationStream
from chainspec.rpc.generated.v1 import verifier_pb2 as pb

UINT64 = 2 ** 64


def choice_specs(spec: GenerationSpec, n: int) -> list[GenerationSpec]:
    """The n per-choice requests of `spec` (n = 1: `spec` itself)."""
    if n == 1:
        return [spec]
    return [dataclasses.replace(
        spec, request_id=f"{spec.request_id}-{i}", parent_request_id=spec.request_id,
        seed=None if spec.seed is None else (spec.seed + i) % UINT64) for i in range(n)]


async def open_all(specs: Sequence[GenerationSpec],
                   open_one: Callable[[GenerationSpec], Awaitable[GenerationStream]]
                   ) -> list[GenerationStream]:
    """Every choice's stream, or the first failure (the others are closed)."""
    tasks = [asyncio.ensure_future(open_one(s)) for s in specs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            if isinstance(r, GenerationStream):
                r.close()
        raise


async def interleave(streams: Sequence[GenerationStream]
                     ) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """(choice index, message) from all streams as they arrive; the first failure
    raises. Messages that arrive together come in index order."""
    iters = [s.messages() for s in streams]
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iters)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                try:
                    msg = task.result()
                except StopAsyncIteration:
                    continue
                yield i, msg
                pending[asyncio.ensure_future(anext(iters[i]))] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def merge_stats(stats: Sequence[pb.RequestStats]) -> pb.RequestStats:
    """One request's counts from its choices': the prompt once, the rest summed."""
    out = pb.RequestStats(prompt_tokens=stats[0].prompt_tokens if stats else 0)
    per_position: list[int] = []
    for s in stats:
        out.completion_tokens += s.completion_tokens
        out.rounds += s.rounds
        out.draft_tokens += s.draft_tokens
        out.accepted_tokens += s.accepted_tokens
        out.fallback_rounds += s.fallback_rounds
        out.resyncs += s.resyncs
        out.cached_tokens = max(out.cached_tokens, s.cached_tokens)  # one prompt
        per_position += [0] * (len(s.accepted_per_position) - len(per_position))
        for k, count in enumerate(s.accepted_per_position):
            per_position[k] += count
    out.accepted_per_position.extend(per_position)
    return out
