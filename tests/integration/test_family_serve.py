"""`chainspec serve` (Ray actors, a gRPC drafter, the HTTP gateway) with each new family's
native MTP layers as the drafter (DeepSeek-V3 and GLM-4.7-Flash with MoE layers and
MoE MTP layers too): greedy output of 8 concurrent streams equals plain
decoding by an in-process engine, and drafts were accepted (the streams' usage). One
stack per family on the session's Ray, each in its own namespace; MiMo-V2-Flash is served
without `--no-chain` (its drafter never chains whatever the flag says)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from chainspec.models.tokenizer import Tokenizer
from tests.integration import helpers
from tests.integration.family_models import SERVED, write_family
from tests.integration.helpers import plain_outputs, prompt_ids, start_serve

pytestmark = pytest.mark.timeout(300)
TOKENS, STREAMS, K = 12, 8, 3


def stream(client: openai.OpenAI, prompt: str) -> tuple[str, dict]:
    text, usage = "", None
    for chunk in client.completions.create(
            model=openai.NOT_GIVEN, prompt=prompt, max_tokens=TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}):
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    return text, usage.model_extra["speculative"]


@pytest.mark.parametrize("family", SERVED)
def test_served_streams_equal_plain_decoding(ray_cluster, tmp_path, family):
    model_dir = write_family(tmp_path / family, family)
    tok = Tokenizer.from_dir(model_dir)
    plain = [tok.decode(t) for t in plain_outputs(model_dir, prompt_ids(model_dir, STREAMS),
                                                  TOKENS)]
    namespace = f"chainspec-family-serve-{family}"
    served = start_serve(model_dir, namespace, "-k", str(K), "--max-seqs", str(STREAMS))
    try:
        assert "1 drafter(s) connected (speculative decoding on)" in served.output()
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
        texts = [tok.decode(ids) for ids in prompt_ids(model_dir, STREAMS)]
        with ThreadPoolExecutor(STREAMS) as pool:
            got = list(pool.map(lambda p: stream(client, p), texts))
    finally:
        helpers.stop_serve(served, namespace, 60)
    assert [text for text, _ in got] == plain
    drafted = sum(s["draft_tokens"] for _, s in got)
    accepted = sum(s["accepted_tokens"] for _, s in got)
    assert accepted > 0.1 * drafted > 0, (accepted, drafted)
    per_pos = [sum(s["accepted_per_position"][i] for _, s in got) for i in range(K)]
    assert per_pos[1] > 0, per_pos  # past the first draft too
    print(f"{family}: accepted {accepted}/{drafted} drafts, per position {per_pos}")
