"""vLLM's `--generation-config auto|vllm|DIR`: the sampling defaults a model ships in its
`generation_config.json` apply to the requests that leave them unset, as in vLLM.

`auto` (default): the served model's file; `vllm`: none (the OpenAI defaults: temperature
1, top_p 1, ...); a directory: that directory's file. The keys vLLM reads are the keys read
here (`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, and
`max_new_tokens` as `max_tokens`); `do_sample` and the rest change nothing, as in vLLM.
Values are checked as a request's are, once, at start: a bad one is one line naming the
file and the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from chainspec.gateway.schemas import CompletionRequest

KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(choice: str, model_dir: str | Path | None
                      ) -> tuple[tuple[str, Any], ...]:
    """(request field, value) pairs for `choice` over the served `model_dir`."""
    if choice == "vllm":
        return ()
    folder = model_dir if choice == "auto" else choice
    path = Path(folder) / "generation_config.json" if folder is not None else None
    if path is None or not path.is_file():
        if choice != "auto":
            raise ValueError(f"--generation-config {choice}: no generation_config.json there")
        return ()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config: {path}: not readable JSON: {e}") from None
    found = {KEYS[k]: v for k, v in data.items() if k in KEYS} if isinstance(data, dict) \
        else {}
    try:
        checked = CompletionRequest.model_validate({"prompt": "", **found})
    except ValidationError as e:
        err = e.errors()[0]
        key = next(k for k, v in KEYS.items() if v == err["loc"][0])
        raise ValueError(f"--generation-config: {path}: {key}: {err['msg'].lower()}, "
                         f"got {err.get('input')!r}") from None
    return tuple((k, getattr(checked, k)) for k in found)
