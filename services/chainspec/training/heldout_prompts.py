"""Text prompts cut from held-out corpus files, shipped beside the demo model
(`heldout_prompts.json`) so that benchmarks and tests prompt it with code it never saw.

Each prompt is a `def` line of a held-out file and the line after it, taken from
different files in turn (files sorted by path), so the set is deterministic.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from chainspec.training.corpus import CorpusSplit, load_split


def cut_prompts(split: CorpusSplit, count: int, max_chars: int = 160) -> list[str]:
    per_file = [_defs(f.text, max_chars) for f in sorted(split.held_out,
                                                          key=lambda f: f.rel_path)]
    prompts: list[str] = []
    depth = 0
    while len(prompts) < count and any(len(d) > depth for d in per_file):
        prompts += [d[depth] for d in per_file if len(d) > depth][: count - len(prompts)]
        depth += 1
    return prompts


def _defs(text: str, max_chars: int) -> list[str]:
    lines = text.splitlines(keepends=True)
    out = []
    for i, line in enumerate(lines[:-1]):
        if line.lstrip().startswith("def ") and line.rstrip().endswith(":"):
            prompt = textwrap.dedent(line + lines[i + 1])
            if len(prompt) <= max_chars and lines[i + 1].strip():
                out.append(prompt)
    return out


def write(model_dir: Path, count: int = 32, held_out_percent: int = 5) -> Path:
    path = Path(model_dir) / "heldout_prompts.json"
    prompts = cut_prompts(load_split(held_out_percent=held_out_percent), count)
    path.write_text(json.dumps(prompts, indent=1) + "\n")
    return path


if __name__ == "__main__":
    import sys
    print(write(Path(sys.argv[1])))
