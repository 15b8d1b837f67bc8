"""Models by Hugging Face Hub id (`--model org/name`), as vLLM takes them.

`resolve_model` turns what the user gave into a local directory once, in the command,
before anything loads: a local directory is itself; anything else is a Hub repository
id fetched with `huggingface_hub.snapshot_download` into its cache (or `download_dir`).
With `HF_HUB_OFFLINE=1` the same call answers from the cache alone (the layout
huggingface_hub writes: `models--org--name/refs/<revision>`, `snapshots/<commit>/` whose
files link into `blobs/`), and a model not cached there is one line saying so.

`served_name` is the name a resolved directory is served under: a snapshot directory
(`.../models--org--name/snapshots/<commit>`) is `org/name`, as in vLLM; any other
directory its own name.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from chainspec.models.errors import CheckpointError

# what a checkpoint directory needs (weights, configs, tokenizer, chat template)
ALLOW_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.md")
_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")
_SNAPSHOT = re.compile(r"models--(?P<repo>.+)/snapshots/[^/]+$")


class ModelNotFound(CheckpointError):
    """Neither a local directory nor a Hub model that could be had."""


def resolve_model(name_or_path: str | Path, revision: str | None = None,
                  download_dir: str | Path | None = None) -> Path:
    """The local directory of a model: `name_or_path` itself when it is a directory,
    else the snapshot of the Hub repository `name_or_path` at `revision` (default: its
    main branch), downloaded into `download_dir` (default: the Hugging Face cache,
    `HF_HUB_CACHE`) unless it is there already. ModelNotFound (one line) otherwise."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if not is_hub_id(name_or_path):
        raise ModelNotFound(f"{name_or_path}: no such model directory (nor a Hub id, "
                            f"org/name)")
    return _snapshot(str(name_or_path), revision, download_dir)


def is_hub_id(text: str | Path) -> bool:
    """`name` or `org/name` and not a local directory (a path: `./x`, `/x`, `~/x`)."""
    text = str(text)
    return bool(_REPO_ID.match(text)) and not text.startswith((".", "/", "~")) and \
        not Path(text).is_dir()


def _snapshot(repo: str, revision: str | None, download_dir: str | Path | None) -> Path:
    import huggingface_hub
    from huggingface_hub import constants, errors

    where = f"{repo}" + (f"@{revision}" if revision else "")
    try:
        return Path(huggingface_hub.snapshot_download(
            repo, revision=revision, cache_dir=download_dir,
            allow_patterns=list(ALLOW_PATTERNS)))
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
        cache = download_dir or constants.HF_HUB_CACHE
        raise ModelNotFound(f"{where}: not a local directory, and not in the Hugging Face "
                            f"cache {cache} (HF_HUB_OFFLINE is set, so nothing is "
                            f"downloaded)" if constants.HF_HUB_OFFLINE else
                            f"{where}: not a local directory, and the Hub could not be "
                            f"reached to download it") from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError,
            errors.GatedRepoError) as e:
        raise ModelNotFound(f"{where}: {type(e).__name__} from the Hugging Face Hub") \
            from None
    except (errors.HfHubHTTPError, OSError) as e:
        raise ModelNotFound(f"{where}: download failed: {str(e).splitlines()[0]}") from None


def fetch_model(repo: str, revision: str | None, model_dir: str | Path,
                download_dir: str | Path) -> Path:
    """The chart's `fetch-model` init container (`model.source: hub`): resolve the Hub
    model into the Hugging Face cache `download_dir` (downloaded unless there already),
    then point `model_dir`, a symlink, at its snapshot (replaced atomically, so pods
    sharing one volume never see a half-made link). `model_dir`."""
    snapshot = _snapshot(repo, revision or None, download_dir)
    link = Path(model_dir)
    link.parent.mkdir(parents=True, exist_ok=True)
    tmp = link.with_name(f".{link.name}.{os.getpid()}.{secrets.token_hex(4)}")
    tmp.symlink_to(os.path.relpath(snapshot, link.parent))
    os.replace(tmp, link)  # NOTE: refuses to replace a real directory
    return link


def served_name(model_dir: str | Path) -> str:
    """`org/name` for a Hub snapshot directory, else the directory's own name."""
    text = Path(model_dir).as_posix().rstrip("/")
    match = _SNAPSHOT.search(text)
    if match is None:
        return Path(text).name
    return match["repo"].replace("--", "/", 1)
