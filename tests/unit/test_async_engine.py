"""AsyncVerifier: same tokens as the synchronous engine, concurrency, abort on cancel,
bounded queue, shutdown fails in-flight requests, idle thread sleeps, a reader behind
takes the outputs waiting as one."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from chainspec.engine.async_engine import (
    AsyncVerifier,
    EngineStopped,
    QueueFull,
    RequestIdInUse,
    _coalesce,
)
from chainspec.engine.logprobs import TokenLogprob
from chainspec.engine.request import FinishReason, RequestOutput, RequestStats, StopConditions
from chainspec.engine.sampling import SamplingParams
from tests.unit.engine_fixtures import engine, outputs, prompts, tied_pair

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def pair():
    return tied_pair()


async def collect(av: AsyncVerifier, rid: str | None, prompt, max_tokens: int = 20):
    tokens, last = [], None
    async for out in av.generate(rid, prompt, GREEDY, StopConditions(max_tokens=max_tokens)):
        tokens.extend(out.new_tokens)
        last = out
    return tokens, last


def test_concurrent_requests_match_sync_engine(pair) -> None:
    target, draft = pair
    ps = prompts(8)
    expected = outputs(engine(target), ps)[0]

    async def main():
        av = AsyncVerifier(engine(target, draft, max_seqs=4))
        try:
            return await asyncio.gather(*(collect(av, f"r{i}", p) for i, p in enumerate(ps)))
        finally:
            av.shutdown()
    results = asyncio.run(main())
    assert [t for t, _ in results] == expected
    assert all(last.finish_reason is FinishReason.LENGTH and last.stats.rounds > 0
               for _, last in results)


def test_cancel_aborts_in_engine_and_frees_the_slot(pair) -> None:
    target, draft = pair

    async def main():
        eng = engine(target, draft, max_seqs=1)
        av = AsyncVerifier(eng)
        gen = av.generate("long", prompts(1)[0], GREEDY, StopConditions(max_tokens=200))
        await gen.__anext__()
        await gen.aclose()  # the client went away
        for _ in range(100):
            if not await av.call(lambda: eng.has_work):
                break
            await asyncio.sleep(0.01)
        freed = await av.call(lambda: (eng.allocator.num_used, eng.drafter.engine.load))
        tokens, _ = await collect(av, "next", prompts(1)[0], 5)  # the slot serves again
        av.shutdown()
        return freed, tokens
    freed, tokens = asyncio.run(main())
    assert freed == (0, 0)  # blocks back, drafter state released
    assert len(tokens) == 5


def test_abort_ends_stream_with_abort(pair) -> None:
    target, _ = pair

    async def main():
        av = AsyncVerifier(engine(target, max_seqs=1))
        task = asyncio.create_task(collect(av, "a", prompts(1)[0], 200))
        await asyncio.sleep(0.05)
        found = await av.abort("a")
        _, last = await task
        missing = await av.abort("nope")
        av.shutdown()
        return found, last, missing
    found, last, missing = asyncio.run(main())
    assert found and not missing
    assert last.finish_reason is FinishReason.ABORT


def test_queue_full_duplicate_id_and_bad_input(pair) -> None:
    target, _ = pair

    async def main():
        av = AsyncVerifier(engine(target, max_seqs=1), max_waiting=1)
        with pytest.raises(ValueError, match="token ids must be in"):
            await av.generate("bad", [10_000], GREEDY, StopConditions()).__anext__()
        gens = [av.generate(f"q{i}", [1, 2], GREEDY, StopConditions(max_tokens=100))
                for i in range(3)]
        await gens[0].__anext__()
        first = asyncio.create_task(gens[1].__anext__())  # waits for the slot
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull, match="1 running and 1 waiting"):
            await gens[2].__anext__()
        with pytest.raises(RequestIdInUse):
            await av.generate("q0", [1], GREEDY, StopConditions()).__anext__()
        first.cancel()
        av.shutdown()
    asyncio.run(main())


def test_shutdown_fails_in_flight_requests(pair) -> None:
    target, _ = pair

    async def main():
        av = AsyncVerifier(engine(target, max_seqs=2))
        task = asyncio.create_task(collect(av, "x", prompts(1)[0], 200))
        await asyncio.sleep(0.05)
        av.shutdown("verifier is going away")
        with pytest.raises(EngineStopped, match="going away"):
            await task
        with pytest.raises(EngineStopped):
            await collect(av, "y", [1])
    asyncio.run(main())


def test_idle_thread_sleeps(pair) -> None:
    target, _ = pair
    av = AsyncVerifier(engine(target))
    t0 = time.process_time()  # all threads of this process
    time.sleep(0.3)
    used = time.process_time() - t0
    av.shutdown()
    assert used < 0.05, f"idle engine thread used {used:.3f} s CPU in 0.3 s"


def test_a_caller_cancelled_while_queued_cannot_kill_the_engine(pair) -> None:
    """A client that hangs up while its command waits behind a busy engine thread left a
    cancelled future; the thread set its result anyway and died (InvalidStateError)."""
    target, draft = pair

    async def main():
        av = AsyncVerifier(engine(target, draft, max_seqs=2))
        try:
            gate = threading.Event()
            av._submit(gate.wait)  # the engine thread is busy until the gate opens
            ran = []
            calls = [asyncio.ensure_future(av.call(lambda i=i: ran.append(i)))
                     for i in range(5)]
            await asyncio.sleep(0.05)
            for c in calls:
                c.cancel()  # the callers went away while their commands were queued
            await asyncio.gather(*calls, return_exceptions=True)  # cancellation lands
            gate.set()
            assert await av.call(lambda: 42) == 42  # the thread outlived them
            assert av.alive and av.failure is None
            tokens, last = await collect(av, "after", prompts(1)[0], max_tokens=5)
            assert last.finish_reason is FinishReason.LENGTH and len(tokens) == 5
            return ran
        finally:
            av.shutdown()
    assert asyncio.run(main()) == []  # a cancelled command does not run


def test_engine_death_is_reported_to_listeners_and_callers(pair) -> None:
    target, draft = pair

    async def main():
        eng = engine(target, draft, max_seqs=2)
        av = AsyncVerifier(eng)
        heard: list[str] = []
        av.on_failure(heard.append)

        def broken_step():
            raise RuntimeError("injected")
        eng.step = broken_step
        with pytest.raises(EngineStopped, match="injected"):
            await collect(av, "r", prompts(1)[0], max_tokens=5)
        for _ in range(100):
            if heard:
                break
            await asyncio.sleep(0.01)
        return av, heard
    av, heard = asyncio.run(main())
    assert heard and "RuntimeError: injected" in heard[0]
    assert av.failure == heard[0] and not av.alive


def test_a_stuck_step_counts_as_stalled_and_a_busy_engine_does_not(pair) -> None:
    target, draft = pair

    async def main():
        av = AsyncVerifier(engine(target, draft, max_seqs=2))
        try:
            assert av.stalled(0.01) is None  # idle
            gate = threading.Event()
            av._submit(gate.wait)
            await asyncio.sleep(0.1)
            reason = av.stalled(0.05)
            gate.set()
            await av.call(lambda: None)
            return reason, av.stalled(0.05)
        finally:
            av.shutdown()
    stuck, after = asyncio.run(main())
    assert stuck is not None and "no progress" in stuck
    assert after is None


def test_coalesce_merges_waiting_outputs_in_order() -> None:
    def lp(t):
        return TokenLogprob(t, -0.5, ((t, -0.5),))

    async def main():
        q: asyncio.Queue = asyncio.Queue()
        stats = RequestStats(3)
        for out in (RequestOutput("r", (2, 3), logprobs=(lp(2), lp(3))),
                    RequestOutput("r", (), logprobs=()),
                    RequestOutput("r", (4,), FinishReason.STOP, "ab", stats=stats,
                                  logprobs=(lp(4),))):
            q.put_nowait(out)
        q.put_nowait(RequestOutput("r", (9,)))  # never merged past a finished output
        first = RequestOutput("r", (1,), logprobs=(lp(1),))
        got, held = _coalesce(first, q)
        assert held is None and q.qsize() == 1
        assert got.new_tokens == (1, 2, 3, 4) and [x.token for x in got.logprobs] == [1, 2, 3, 4]
        assert (got.finish_reason, got.stop_string, got.stats) == (FinishReason.STOP, "ab", stats)
        # no logprobs asked: None stays None; an EngineStopped ends the merge, handed back
        q2: asyncio.Queue = asyncio.Queue()
        stop = EngineStopped("gone")
        for item in (RequestOutput("s", (5,)), stop, RequestOutput("s", (6,))):
            q2.put_nowait(item)
        got, held = _coalesce(RequestOutput("s", (4,)), q2)
        assert got.new_tokens == (4, 5) and got.logprobs is None and held is stop
        assert not got.finished
    asyncio.run(main())


def test_a_reader_behind_gets_several_steps_in_one_output(pair) -> None:
    """A reader that takes its time gets the steps it missed as one output, token for
    token what a prompt reader gets (and what the sync engine makes)."""
    target, _ = pair
    ps = prompts(1)
    expected = outputs(engine(target), ps, max_tokens=30)[0][0]

    async def main():
        av = AsyncVerifier(engine(target))
        tokens, n = [], 0
        try:
            async for out in av.generate("slow", ps[0], GREEDY, StopConditions(max_tokens=30)):
                tokens.extend(out.new_tokens)
                n += 1
                await asyncio.sleep(0.05)  # several plain steps land meanwhile
        finally:
            av.shutdown()
        return tokens, n
    tokens, n = asyncio.run(main())
    assert tokens == expected and n < 30


def test_steps_landing_while_the_loop_is_busy_share_one_wake_up(pair) -> None:
    """While a wake-up waits for a busy event loop, later steps' outputs join it rather
    than each writing another (a self-pipe write and a GIL hand-off per step); every token
    still arrives, in order, as the sync engine makes them."""
    target, _ = pair
    ps = prompts(1)
    expected = outputs(engine(target), ps, max_tokens=30)[0][0]

    async def main():
        loop, wakes = asyncio.get_running_loop(), []
        post = loop.call_soon_threadsafe

        def counted(fn, *args, **kw):
            wakes.append(getattr(fn, "__name__", ""))
            return post(fn, *args, **kw)
        loop.call_soon_threadsafe = counted
        av = AsyncVerifier(engine(target))
        tokens, busy = [], None
        try:
            async for out in av.generate("r", ps[0], GREEDY, StopConditions(max_tokens=30)):
                tokens.extend(out.new_tokens)
                if busy is None:
                    steps, posted = av.steps, len(wakes)
                    time.sleep(0.5)  # NOTE: blocks the loop; the engine keeps stepping
                    busy = (av.steps - steps, wakes[posted:])
        finally:
            av.shutdown()
        return tokens, busy
    tokens, (steps, posted) = asyncio.run(main())
    assert tokens == expected
    # NOTE: at most one: the next step's wake-up may already wait when the block begins
    assert steps >= 5 and len(posted) <= 1 and set(posted) <= {"_wake"}


def test_a_closed_loop_keeps_no_outputs_waiting(pair) -> None:
    """A loop that closed with a wake-up still queued (its clients gone mid-request)
    never runs it: the steps after the close drop that loop's waiting outputs rather
    than piling them up for a loop that will not take them."""
    target, _ = pair
    av = AsyncVerifier(engine(target))
    loop = asyncio.new_event_loop()

    async def first_output():
        stream = av.generate("r", prompts(1)[0], GREEDY, StopConditions(max_tokens=200))
        await stream.__anext__()
        return stream
    try:
        stream = loop.run_until_complete(first_output())  # noqa: F841 (left open)
        deadline = time.monotonic() + 10
        while loop not in av._pending and time.monotonic() < deadline:
            time.sleep(0.01)  # the loop is stopped: the next step's wake-up waits
        assert loop in av._pending
        loop.close()
        steps = av.steps
        while av.steps < steps + 3 and av.engine.has_work and time.monotonic() < deadline:
            time.sleep(0.01)
        assert av.steps >= steps + 3 and loop not in av._pending
    finally:
        av.shutdown()
