"""`chainspec serve -tp 2` (issue 22 must-show): the verifier actor is rank 0 of a TP=2
group (rank 1 a process it starts, gloo), paired with a remote gRPC drafter at TP=1 by the
group's fingerprint. Greedy output of 16 concurrent streams equals plain decoding by an
in-process TP=1 engine, and drafts were accepted."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from chainspec.engine.local import DEMO_MODEL
from chainspec.models.tokenizer import Tokenizer
from tests.integration import helpers
from tests.integration.helpers import plain_outputs, prompt_ids, start_serve

pytestmark = pytest.mark.timeout(300)
TOKENS, STREAMS, K = 12, 16, 3


def complete(client: openai.OpenAI, prompt: str) -> tuple[str, dict]:
    out = client.completions.create(model=openai.NOT_GIVEN, prompt=prompt, max_tokens=TOKENS,
                                    temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text, out.usage.model_extra["speculative"]


def test_tp2_verifier_serves_streams_equal_to_plain(ray_cluster):
    tok = Tokenizer.from_dir(DEMO_MODEL)
    ids = prompt_ids(DEMO_MODEL, STREAMS)
    plain = [tok.decode(t) for t in plain_outputs(DEMO_MODEL, ids, TOKENS)]
    namespace = "chainspec-tp-serve"
    served = start_serve(DEMO_MODEL, namespace, "-k", str(K), "--max-seqs", str(STREAMS),
                         "-tp", "2")
    try:
        assert "1 drafter(s) connected (speculative decoding on)" in served.output()
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        with ThreadPoolExecutor(STREAMS) as pool:
            got = list(pool.map(lambda p: complete(client, p), [tok.decode(i) for i in ids]))
    finally:
        helpers.stop_serve(served, namespace)
    assert [text for text, _ in got] == plain
    accepted = sum(s["accepted_tokens"] for _, s in got)
    drafted = sum(s["draft_tokens"] for _, s in got)
    assert accepted > 0.1 * drafted > 0, (accepted, drafted)
