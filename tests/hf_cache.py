"""A Hugging Face cache laid out the way huggingface_hub writes it, for offline tests:
`models--org--name/blobs/<sha256>` (the files), `refs/<branch>` (a commit hash) and
`snapshots/<commit>/<file>` (relative symlinks into blobs/)."""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path


def add_to_cache(cache: Path, repo_id: str, source: Path, branch: str = "main",
                 commit: str | None = None) -> Path:
    """Cache every file of `source` as `repo_id` at a new (or given) 40-hex commit that
    `refs/<branch>` names; the snapshot directory."""
    commit = commit or secrets.token_hex(20)
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / branch).write_text(commit)
    return snapshot
