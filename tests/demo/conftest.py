"""Fixtures over the bundled demo model (loaded once per session)."""

from __future__ import annotations

import json

import pytest

from chainspec.engine.local import DEMO_MODEL, LocalOptions, load_models
from chainspec.models.tokenizer import Tokenizer

PROMPT_FILE = DEMO_MODEL / "heldout_prompts.json"


@pytest.fixture(scope="session")
def demo_models():
    opts = LocalOptions(DEMO_MODEL, num_steps=4, max_seqs=8, max_len=512)
    return opts, load_models(opts, speculative=True)


@pytest.fixture(scope="session")
def demo_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEMO_MODEL)


@pytest.fixture(scope="session")
def heldout_prompts(demo_tokenizer) -> list[list[int]]:
    """Prompts cut from held-out standard-library files (never trained on)."""
    texts = json.loads(PROMPT_FILE.read_text())
    assert len(texts) >= 20
    return [demo_tokenizer.encode(t) for t in texts]
