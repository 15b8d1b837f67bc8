"""The prompts a sweep sends: a model's held-out prompts, random token prompts of given
input/output lengths, or a JSONL file. Each point draws `n` requests from the same list,
cycling, so every load point sends the same requests in the same order."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | tuple[int, ...]  # text, or token ids (OpenAI completions accept both)
    max_tokens: int
    prompt_len: int | None = None  # tokens, where known before sending


@dataclass(frozen=True)
class Dataset:
    name: str
    requests: tuple[BenchRequest, ...]

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError(f"dataset {self.name!r} has no requests")

    def take(self, n: int, offset: int = 0) -> list[BenchRequest]:
        return [self.requests[(offset + i) % len(self.requests)] for i in range(n)]


def heldout(model_dir: Path, output_len: int) -> Dataset:
    """`heldout_prompts.json` of a chainspec model directory (the demo model ships one)."""
    check_output_len(output_len)
    path = Path(model_dir) / "heldout_prompts.json"
    try:
        prompts = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read held-out prompts {path}: {e}") from None
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"{path}: expected a JSON list of prompt strings")
    return Dataset(f"heldout:{path}", tuple(BenchRequest(p, output_len) for p in prompts))


def check_output_len(output_len: int) -> None:
    if output_len < 1:
        raise ValueError(f"--output-len must be >= 1, got {output_len}")


def random_tokens(vocab_size: int, input_len: int, output_len: int, range_ratio: float,
                  n: int, seed: int) -> Dataset:
    """`n` prompts of uniform random token ids; lengths uniform in len * [1 - r, 1 + r]."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    rng = random.Random(seed)

    def length(mean: int) -> int:
        lo, hi = max(1, round(mean * (1 - range_ratio))), round(mean * (1 + range_ratio))
        return rng.randint(lo, max(lo, hi))

    requests = []
    for _ in range(n):
        ids = tuple(rng.randrange(vocab_size) for _ in range(length(input_len)))
        requests.append(BenchRequest(ids, length(output_len), len(ids)))
    return Dataset(f"random:in={input_len},out={output_len},ratio={range_ratio}",
                   tuple(requests))


def jsonl(path: Path, output_len: int) -> Dataset:
    """One JSON object a line: `{"prompt": str | [ids], "max_tokens"?: int}`; lines
    without `max_tokens` get `output_len`."""
    check_output_len(output_len)
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--dataset-path {path}: cannot read it: "
                         f"{getattr(e, 'strerror', None) or e}") from None
    requests = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"]
            if isinstance(prompt, list):
                prompt = tuple(int(t) for t in prompt)
            max_tokens = int(row.get("max_tokens", output_len))
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{i}: expected a JSON object with a \"prompt\" (text "
                             "or token ids) and an optional integer \"max_tokens\"") from None
        if not isinstance(prompt, (str, tuple)) or max_tokens < 1:
            raise ValueError(f"{path}:{i}: \"prompt\" must be text or token ids and "
                             "\"max_tokens\" >= 1")
        requests.append(BenchRequest(prompt, max_tokens,
                                     len(prompt) if isinstance(prompt, tuple) else None))
    return Dataset(f"jsonl:{path}", tuple(requests))
