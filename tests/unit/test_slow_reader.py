"""A reader that stops taking a request's tokens gets its request aborted once it is
`max_buffered_tokens` behind (AsyncVerifier), so an unread stream frees its sequence;
a reader that keeps up never is."""

from __future__ import annotations

import asyncio

import pytest

from chainspec.engine.async_engine import AsyncVerifier
from chainspec.engine.request import FinishReason, StopConditions
from chainspec.engine.sampling import SamplingParams
from tests.unit.engine_fixtures import engine, prompts, tied_pair

GREEDY = SamplingParams(temperature=0.0)
BOUND = 16
LONG = StopConditions(max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def pair():
    return tied_pair()


def test_an_unread_stream_is_aborted_and_frees_its_slot(pair) -> None:
    async def main():
        eng = engine(*pair, max_seqs=2)
        av = AsyncVerifier(eng, max_buffered_tokens=BOUND)
        try:
            gen = av.generate("unread", prompts(1)[0], GREEDY, LONG)
            await gen.__anext__()  # ... and then stops reading, without leaving
            for _ in range(400):
                if not await av.call(lambda: eng.has_work):
                    break
                await asyncio.sleep(0.01)
            idle = not await av.call(lambda: eng.has_work)
            rest = [out async for out in gen]
            return idle, rest
        finally:
            av.shutdown()
    idle, rest = asyncio.run(main())
    assert idle  # the sequence left the engine while its reader slept
    assert rest[-1].finish_reason is FinishReason.ABORT
    unread = sum(len(o.new_tokens) for o in rest)
    assert BOUND < unread < LONG.max_tokens  # stopped soon after the bound, far from the end


def test_a_reader_that_keeps_up_is_never_aborted(pair) -> None:
    async def main():
        # NOTE: 4x the bound: on a loaded machine a few steps' outputs may land together
        av = AsyncVerifier(engine(*pair, max_seqs=2), max_buffered_tokens=4 * BOUND)
        try:
            outs = [out async for out in av.generate("read", prompts(1)[0], GREEDY, LONG)]
        finally:
            av.shutdown()
        return outs
    outs = asyncio.run(main())
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(o.new_tokens) for o in outs) == LONG.max_tokens
