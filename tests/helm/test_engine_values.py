"""The engine's KV and drafting values reach the stack config the chart renders: the
paged KV budget (bytes past 2^31 and fractions stay numbers), block size, draft top-k and
CUDA graphs; the defaults equal StackConfig's own; bad values are refused by the schema."""

import pytest

from chainspec.cluster.config import StackConfig
from tests.helm.render import HelmError, stack_config, template


def test_defaults_are_the_stack_configs():
    config = stack_config(template())
    default = StackConfig()
    assert (config.kv_cache_memory, config.kv_cache_fraction) == (None, None)
    assert (config.kv_block_size, config.draft_top_k, config.use_graphs) == \
        (default.kv_block_size, default.draft_top_k, default.use_graphs)


def test_values_reach_the_stack_config():
    config = stack_config(template("--set", "stack.kvCacheMemoryBytes=80000000000",
                                   "--set", "stack.kvBlockSize=32",
                                   "--set", "stack.draftTopK=4",
                                   "--set", "stack.cudaGraphs=false"))
    assert config.kv_cache_memory == 80_000_000_000  # 80 GB: no float, no exponent
    assert (config.kv_block_size, config.draft_top_k, config.use_graphs) == (32, 4, False)
    config = stack_config(template("--set-json", "stack.kvCacheFraction=0.85"))
    assert config.kv_cache_fraction == pytest.approx(0.85)


@pytest.mark.parametrize("bad", ["stack.kvBlockSize=0", "stack.draftTopK=0",
                                 "stack.kvCacheFraction=1.5", "stack.kvCacheMemoryBytes=0"])
def test_bad_values_are_refused(bad):
    with pytest.raises(HelmError):
        template("--set-json", bad)
