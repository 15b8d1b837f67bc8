"""The verifier -> drafter link heals: keepalive settings agree on both ends (an idle link
is never answered GOAWAY too_many_pings), and a stream that ends for any reason is
reconnected with backoff while the drafter is still wanted, so speculation comes back."""

from __future__ import annotations

import copy
import time

import pytest

from chainspec.rpc.channel import ClientOptions
from chainspec.rpc.draft_pool import DrafterMatch, GrpcDraftClient, LinkState
from tests.integration.grpc_helpers import (
    drafter_engine,
    free_port,
    start_drafter,
    wait_until,
)
from tests.integration.test_draft_pool import MAX_TOKENS, Driver, K
from tests.unit.engine_fixtures import engine, outputs, prompts

pytestmark = pytest.mark.timeout(120)
# production keepalive (30 s) scaled down 30x: gRPC core sends pings at most about once a
# second, and a server that permits them only every 5 min (its default) answers the 3rd
# early one with GOAWAY too_many_pings (3 s here, ~2.5 min in production)
KEEPALIVE_S = 1.0


def _drafter(loop, models, **opts):
    """A drafter server; `srv.updates` counts the engine's update rounds."""
    eng = drafter_engine(copy.deepcopy(models[1]), k=K)
    srv = start_drafter(loop, eng, keepalive_time_s=KEEPALIVE_S, **opts)
    srv.engine, srv.updates, update = eng, [], eng.update

    def counted(updates):
        srv.updates.append(len(updates))
        return update(updates)
    eng.update = counted
    return srv


def _client(target, address: str) -> GrpcDraftClient:
    return GrpcDraftClient([address], ClientOptions(keepalive_time_s=KEEPALIVE_S),
                           round_deadline_s=10.0,
                           match=DrafterMatch(K, 32, target.config.vocab_size))


def _speculative_run(target, client, ps) -> tuple[list[list[int]], int]:
    """Greedy outputs of `ps` and the draft tokens they accepted."""
    out, result = outputs(engine(target, client=client, k=K), ps, MAX_TOKENS)
    return out, sum(c.stats.accepted_tokens for c in result.completions)


def test_an_idle_link_keeps_speculating(loop, models) -> None:
    target = models[0]
    ps = prompts(2, vocab=target.config.vocab_size, seed=5)
    plain = outputs(engine(target), ps, MAX_TOKENS)[0]
    srv = _drafter(loop, models)
    client = _client(target, srv.address)
    try:
        assert _speculative_run(target, client, ps)[0] == plain
        time.sleep(5 * KEEPALIVE_S)  # idle for several keepalive periods (3x is the bar)
        assert client.states() == {srv.address: LinkState.LIVE}
        assert client.stats.stream_failures == 0, "the drafter sent GOAWAY to an idle link"
        got, accepted = _speculative_run(target, client, ps)
        assert got == plain and accepted > 0
    finally:
        client.close()
        loop.run(srv.stop(0))


def test_a_link_ended_by_goaway_reconnects_and_sequences_resync(loop, models) -> None:
    """The drafter restarts on its port mid-run (GOAWAY to the open stream): within 5 s
    the link is live again, running sequences resync onto it and draft again, and every
    output still equals plain decoding."""
    target = models[0]
    ps = prompts(4, vocab=target.config.vocab_size, seed=9)
    plain = outputs(engine(target), ps, 64)[0]
    port = free_port()
    srv = _drafter(loop, models, port=port)
    client = _client(target, srv.address)
    drive = Driver(engine(target, client=client, k=K), max_tokens=64)
    replacement = None
    try:
        ids = drive.add(ps, "r")
        drive.step(3)
        loop.run(srv.stop(0.5))  # GOAWAY, then the stream is cut
        replacement = _drafter(loop, models, port=port)
        gone = time.monotonic()
        assert wait_until(lambda: client.states() == {srv.address: LinkState.LIVE}, 5.0), \
            f"no reconnect within 5 s: {client.states()}"
        healed_s = time.monotonic() - gone
        drive.finish()
        assert [drive.tokens[r] for r in ids] == plain
        assert client.stats.stream_failures >= 1 and client.stats.reconnects >= 1
        assert wait_until(lambda: replacement.engine.load == 0, 5.0)  # all released again
        assert replacement.updates, "no sequence came back to the new drafter"
        print(f"reconnected in {healed_s:.2f} s")
    finally:
        client.close()
        if replacement is not None:
            loop.run(replacement.stop(0))


def test_a_drafter_that_was_down_at_start_is_connected_once_it_comes_up(loop, models) -> None:
    target = models[0]
    port = free_port()
    address = f"127.0.0.1:{port}"
    client = GrpcDraftClient((), ClientOptions(keepalive_time_s=KEEPALIVE_S),
                             round_deadline_s=10.0, connect_timeout_s=0.5,
                             match=DrafterMatch(K, 32, target.config.vocab_size))
    srv = None
    try:
        client.set_endpoints([address])
        assert wait_until(lambda: client.states()[address] is LinkState.DEAD, 5.0)
        srv = _drafter(loop, models, port=port)
        assert wait_until(lambda: client.states()[address] is LinkState.LIVE, 10.0), \
            "a wanted drafter that came up late was never connected"
        ps = prompts(2, vocab=target.config.vocab_size, seed=3)
        got, accepted = _speculative_run(target, client, ps)
        assert got == outputs(engine(target), ps, MAX_TOKENS)[0] and accepted > 0
    finally:
        client.close()
        if srv is not None:
            loop.run(srv.stop(0))


def test_a_removed_drafter_is_not_reconnected(loop, models) -> None:
    target = models[0]
    srv = _drafter(loop, models, port=free_port())
    client = _client(target, srv.address)
    try:
        client.set_endpoints([])
        loop.run(srv.stop(0))
        time.sleep(1.0)
        assert client.states() == {}
        assert client.stats.reconnects == 0
    finally:
        client.close()
