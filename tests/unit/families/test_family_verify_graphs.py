"""The verifier's static-buffer step (what CUDA graphs replay) for the families with
windowed groups (MiMo-V2-Flash, Step-3.5-Flash), recurrent states (Qwen3.5, Qwen3-Next) and latent
caches (DeepSeek-V3), run eagerly on CPU: every decode/verify step of an engine run equals the
packed step from the same cache (hidden rows, cache values, and the very entries written:
padding rows and padding sequences write nothing, state rows past a ragged window stay
as they were), with buckets padded, windows ragged and window blocks given back; and the
engine's output equals plain decoding, speculative and not."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch

from chainspec.engine.verify_graphs import VerifyGraphs
from chainspec.models.loader import load_draft_model, load_target
from tests.unit.engine_fixtures import engine, outputs
from tests.unit.families.graph_check import BLOCKS, CHUNK, FAMILIES, checked, prompts, write_family
from tests.unit.kernels.interpreted import check_names as _check_names
from tests.unit.kernels.interpreted import interpreted_results

MAX_TOKENS = 14
K = 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_family(request.param, path)
    target = load_target(path)
    plain = outputs(engine(target, chunk=CHUNK, kv=BLOCKS, max_seqs=4), prompts(3),
                    MAX_TOKENS)[0]
    return request.param, target, load_draft_model(path), plain


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "spec"])
def test_static_steps_equal_packed_steps_and_output_equals_plain(family, speculative):
    name, target, draft, plain = family
    eng = engine(target, draft if speculative else None, k=K, chunk=CHUNK, kv=BLOCKS,
                 drafter_kv=BLOCKS, max_seqs=4, sampled_drafts=False)
    graphs = checked(eng)
    got, result = outputs(eng, prompts(3), MAX_TOKENS)
    assert got == plain
    assert graphs.checked > 0 and graphs.eager_runs == graphs.checked  # the static path ran
    assert graphs.padded > 0  # 3 sequences in bucket 4: a padding sequence
    if not speculative:
        assert graphs.ragged > 0  # decode rows: windows shorter than K+1 rows
    assert graphs.hidden_diff < 1e-4 and graphs.cache_diff < 1e-4
    assert graphs.same_writes, "the static step wrote entries the packed step did not"
    if eng.cache.windows:
        assert graphs.trimmed > 0  # tables with given-back blocks went through the buffers
    if speculative:
        accepted = sum(c.stats.accepted_tokens for c in result.completions)
        assert accepted > 0, f"{name}: no draft accepted, nothing at stake"


def test_graph_safe_is_a_layer_capability(family):
    """GDN's torch path (CPU tensors) loops over host spans: a Qwen3.5 target is not
    graph-safe there (its kernels are, below); window groups and latent caches are device
    tensors only."""
    name, target, _, _ = family
    assert target.graph_safe is (name not in ("qwen3_5", "qwen3_next"))
    graphs = VerifyGraphs(target, engine(target, kv=BLOCKS).cache, 4, K, 256,
                          use_graphs=True)
    assert not graphs.use_graphs and not graphs.enabled  # on CPU: never, packed path


def check_gdn_kernels_on_static_buffers_equal_the_packed_path() -> None:
    """In Triton's interpreter, as on CUDA: Qwen3.5 with its GDN kernels is graph-safe,
    and decode steps on the static buffers (rows padded to K+1 per sequence, a padding
    sequence) equal packed steps, the kernels writing no state row the packed path does
    not write."""
    with tempfile.TemporaryDirectory() as tmp:
        write_family("qwen3_5", Path(tmp))
        target = load_target(Path(tmp))
    assert target.graph_safe
    eng = engine(target, k=K, chunk=CHUNK, kv=BLOCKS, max_seqs=4)
    graphs = checked(eng)
    outputs(eng, prompts(3), 8)
    assert graphs.checked > 0 and graphs.padded > 0 and graphs.ragged > 0
    assert graphs.hidden_diff < 1e-4 and graphs.cache_diff < 1e-4
    assert graphs.same_writes, "the static step wrote entries the packed step did not"


interpreted = interpreted_results(__name__)


@pytest.mark.parametrize("name", _check_names(sys.modules[__name__]))
def test_in_the_interpreter(name: str, interpreted: dict[str, str]) -> None:
    assert interpreted[name] == "", interpreted[name]
