"""`python -m chainspec.demo` (`make demo`) end to end on a tiny checkpoint and the
session's Ray: completions, a streamed chat, and speculative vs plain on one stack with
identical text; everything it started is gone afterwards."""

from __future__ import annotations

import pytest

from chainspec.cluster import stack
from chainspec.demo import NAMESPACE, main

pytestmark = pytest.mark.timeout(300)


def test_demo_runs_and_cleans_up(ray_cluster, model_dir, capsys) -> None:
    assert main(["--model", str(model_dir), "--prompts", "2", "--max-tokens", "16",
                 "--max-len", "256"]) == 0
    out = capsys.readouterr().out
    for needle in ("== 1. completions", "acceptance length", "== 2. a streamed chat",
                   "speculative (1 drafter)", "plain (0 drafters)",
                   "identical text with and without drafts: yes", "done."):
        assert needle in out, out
    with pytest.raises(stack.StackNotFound):
        stack.status(namespace=NAMESPACE)


def test_demo_without_a_model_says_how_to_get_one(tmp_path, capsys) -> None:
    assert main(["--model", str(tmp_path / "missing")]) == 1
    assert "make train-demo" in capsys.readouterr().err
