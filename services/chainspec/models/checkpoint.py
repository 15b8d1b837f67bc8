"""Which safetensors file of a model directory holds each tensor, and reading them.

The rule (recorded in docs/design.md):
- every `*.safetensors.index.json` in the directory contributes its `weight_map`; files it
  names are opened only when one of their tensors is read, so a loader that needs a few
  tensors never touches the other shards;
- every other `*.safetensors` file in the directory (not named by an index) is opened for
  its header and contributes all its tensors, e.g. an `mtp.safetensors` holding MTP
  modules beside a transformers-loadable `model.safetensors`;
- `consolidated*.safetensors` (Mistral's native-format duplicate of the weights) is skipped;
- a tensor name found in two files is an error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from chainspec.models.errors import CheckpointError

INDEX_SUFFIX = ".safetensors.index.json"
SKIPPED_PREFIX = "consolidated"


class CheckpointFiles:
    """Tensor name -> file map of one directory, with lazily opened files."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._file_of: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        indexed = self._read_indexes()
        for path in sorted(self.model_dir.glob("*.safetensors")):
            if path.name not in indexed and not path.name.startswith(SKIPPED_PREFIX):
                for name in self._open(path).keys():
                    self._add(name, path)
        if not self._file_of:
            raise CheckpointError(f"{self.model_dir}: no *.safetensors tensors found")

    def names(self) -> set[str]:
        return set(self._file_of)

    def file_of(self, name: str) -> Path:
        if name not in self._file_of:
            raise CheckpointError(f"{self.model_dir}: missing tensor {name}")
        return self._file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape, read from the file header (no tensor data)."""
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, shape: tuple[int, ...] | None = None,
             data: bool = True) -> torch.Tensor:
        """Read one tensor; with `shape`, check it against the header first. `data`
        False: only the header is read (an empty tensor on the meta device)."""
        stored = self.shape(name)
        if shape is not None and stored != tuple(shape):
            raise CheckpointError(f"{self.file_of(name)}: tensor {name} has shape "
                                  f"{list(stored)}, expected {list(shape)}")
        if not data:
            return torch.empty(stored, device="meta")
        return self._handle(name).get_tensor(name)

    def read_part(self, name: str, shape: tuple[int, ...], dim: int, start: int,
                  stop: int) -> torch.Tensor:
        """Indices [start, stop) along `dim` of a tensor stored with `shape`; only that
        part is read from the file (a tensor-parallel rank's shard)."""
        self.read(name, shape, data=False)  # the header check
        index = (slice(None),) * dim + (slice(start, stop),)
        return self._slice(name)[index]

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> CheckpointFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_indexes(self) -> set[str]:
        indexed: set[str] = set()
        for index in sorted(self.model_dir.glob(f"*{INDEX_SUFFIX}")):
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from e
            for name, file in weight_map.items():
                path = self.model_dir / file
                if not path.is_file():
                    raise CheckpointError(f"{index}: lists {file}, which does not exist")
                self._add(name, path)
                indexed.add(file)
        return indexed

    def _add(self, name: str, path: Path) -> None:
        other = self._file_of.setdefault(name, path)
        if other != path:
            raise CheckpointError(f"{self.model_dir}: tensor {name} is in both {other.name} "
                                  f"and {path.name}")

    def _open(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except SafetensorError as e:
                raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from e
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open ({e})") from e
        return self._handles[path]

    def _handle(self, name: str):
        return self._open(self.file_of(name))

    def _slice(self, name: str):
        try:
            return self._handle(name).get_slice(name)
        except SafetensorError as e:
            raise CheckpointError(f"{self.file_of(name)}: has no tensor {name} ({e})") from e
