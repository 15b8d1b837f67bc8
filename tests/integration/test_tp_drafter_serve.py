"""`chainspec serve -tp 2 --drafter-tensor-parallel-size 2` (issue 22 item 3 must-show):
the verifier member is rank 0 of a TP=2 group and the drafter member rank 0 of another,
whose rank 1 is a Ray actor in bundle 1 of the drafter member's placement group (rank 0
in bundle 0; `cluster/tp_ranks.py`). Greedy output of 16 concurrent streams equals plain
decoding by an in-process TP=1 engine, drafts were accepted, and the drafter member
reports its two ranks alive, each its own process. Then SIGKILL the drafter's rank 1:
16 more streams still equal plain (a lost drafter costs speed only), and the member
comes back as a whole new group (both ranks new processes)."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import ray

from chainspec.cluster.intent import actor_name
from chainspec.engine.local import DEMO_MODEL
from chainspec.models.tokenizer import Tokenizer
from tests.integration import helpers
from tests.integration.helpers import plain_outputs, prompt_ids, start_serve
from tests.integration.test_tp_serve import STREAMS, TOKENS, K, complete

pytestmark = pytest.mark.timeout(300)


def test_tp2_drafter_and_tp2_verifier_serve_streams_equal_to_plain(ray_cluster):
    tok = Tokenizer.from_dir(DEMO_MODEL)
    ids = prompt_ids(DEMO_MODEL, STREAMS)
    plain = [tok.decode(t) for t in plain_outputs(DEMO_MODEL, ids, TOKENS)]
    namespace = "chainspec-tp-drafter-serve"
    served = start_serve(DEMO_MODEL, namespace, "-k", str(K), "--max-seqs", str(STREAMS),
                         "-tp", "2", "--drafter-tensor-parallel-size", "2")
    try:
        assert "1 drafter(s) connected (speculative decoding on)" in served.output()
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        texts = [tok.decode(i) for i in ids]
        with ThreadPoolExecutor(STREAMS) as pool:
            got = list(pool.map(lambda p: complete(client, p), texts))
        drafter = ray.get_actor(actor_name("drafter-0"), namespace=namespace)
        ranks = ray.get(drafter.ping.remote(), timeout=30)["ranks"]
        os.kill(ranks[1]["pid"], signal.SIGKILL)
        with ThreadPoolExecutor(STREAMS) as pool:
            after_kill = list(pool.map(lambda p: complete(client, p), texts))
        back = _new_group(drafter, {r["pid"] for r in ranks})
    finally:
        helpers.stop_serve(served, namespace)
    assert [text for text, _ in got] == plain
    accepted = sum(s["accepted_tokens"] for _, s in got)
    drafted = sum(s["draft_tokens"] for _, s in got)
    assert accepted > 0.1 * drafted > 0, (accepted, drafted)
    assert [(r["rank"], r["state"]) for r in ranks] == [(0, "alive"), (1, "alive")]
    assert ranks[0]["pid"] != ranks[1]["pid"]
    assert [text for text, _ in after_kill] == plain
    assert back, "the drafter group did not come back as new processes"


def _new_group(drafter, old_pids: set[int], timeout_s: float = 90.0) -> bool:
    """Both ranks alive again, neither an old process."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ranks = ray.get(drafter.ping.remote(), timeout=10)["ranks"] or []
        except Exception:  # noqa: BLE001 (restarting)
            ranks = []
        if len(ranks) == 2 and all(r["state"] == "alive" and r["pid"] not in old_pids
                                   for r in ranks):
            return True
        time.sleep(0.5)
    return False
