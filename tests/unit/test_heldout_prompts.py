"""Held-out prompts come from held-out files only, deterministically, spread over files."""

from __future__ import annotations

from chainspec.training.corpus import CorpusFile, CorpusSplit
from chainspec.training.heldout_prompts import cut_prompts

TRAIN = CorpusFile("a.py", "def seen(x):\n    return x\n")
HELD = (CorpusFile("b.py", "class C:\n    def f(self):\n        return 1\n"
                           "def g():\n    pass\n"),
        CorpusFile("c.py", "def h(y):\n    return y\n"))


def test_prompts_are_cut_from_held_out_files_in_turn() -> None:
    split = CorpusSplit("/", (TRAIN,), HELD)
    prompts = cut_prompts(split, 3)
    assert prompts == ["def f(self):\n    return 1\n", "def h(y):\n    return y\n",
                       "def g():\n    pass\n"]  # first def of each file, then the next
    assert not any("seen" in p for p in prompts)
    assert cut_prompts(split, 3) == prompts
    assert len(cut_prompts(split, 10)) == 3  # no more than the files hold
