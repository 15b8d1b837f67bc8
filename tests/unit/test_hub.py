"""Hub ids resolve through huggingface_hub's own cache (offline: nothing is fetched)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from huggingface_hub import constants

from chainspec.models.hub import ModelNotFound, resolve_model, served_name
from tests.hf_cache import add_to_cache


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE=1 with an empty cache of its own (huggingface_hub reads both at
    import, so its constants are patched too)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


def model_files(tmp_path, name: str, text: str):
    src = tmp_path / name
    src.mkdir()
    (src / "config.json").write_text(text)
    (src / "model.safetensors").write_bytes(b"weights " + text.encode())
    return src


def test_a_local_directory_is_itself(tmp_path, offline):
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(str(tmp_path), revision="v1") == tmp_path


def test_a_cached_hub_id_resolves_offline_to_the_snapshot_refs_main_names(tmp_path, offline):
    add_to_cache(offline, "org/name", model_files(tmp_path, "old", '{"v": 1}'))
    new = add_to_cache(offline, "org/name", model_files(tmp_path, "new", '{"v": 2}'))
    got = resolve_model("org/name")
    assert got == new and (got / "config.json").read_text() == '{"v": 2}'
    assert (got / "config.json").is_symlink()  # huggingface_hub's layout, not a copy
    assert served_name(got) == "org/name"


def test_a_revision_picks_a_branch_or_a_commit(tmp_path, offline):
    old = add_to_cache(offline, "org/name", model_files(tmp_path, "a", '{"v": 1}'),
                       branch="v1")
    add_to_cache(offline, "org/name", model_files(tmp_path, "b", '{"v": 2}'))
    assert resolve_model("org/name", revision="v1") == old
    assert resolve_model("org/name", revision=old.name) == old


def test_download_dir_is_the_cache_to_read(tmp_path, offline):
    other = tmp_path / "elsewhere"
    snap = add_to_cache(other, "org/name", model_files(tmp_path, "m", "{}"))
    assert resolve_model("org/name", download_dir=other) == snap
    with pytest.raises(ModelNotFound):  # not in the default cache
        resolve_model("org/name")


@pytest.mark.parametrize("name,words", [
    ("org/missing", ["org/missing", "not in the Hugging Face cache", "HF_HUB_OFFLINE"]),
    ("./no/such/dir", ["no such model directory"]),
    ("/abs/nowhere", ["no such model directory"]),
])
def test_what_cannot_be_had_is_one_line(name, words, offline):
    with pytest.raises(ModelNotFound) as e:
        resolve_model(name)
    message = str(e.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_served_names():
    assert served_name("/c/models--Qwen--Qwen3-0.6B/snapshots/" + "a" * 40) == "Qwen/Qwen3-0.6B"
    assert served_name("/c/models--Qwen--Qwen3-0.6B/snapshots/" + "a" * 40 + "/") == \
        "Qwen/Qwen3-0.6B"
    assert served_name("/data/my-model") == "my-model"



def test_fetch_model_links_the_model_dir_to_the_snapshot_in_its_cache(tmp_path, offline):
    from chainspec.models.hub import fetch_model
    volume = tmp_path / "models"
    add_to_cache(volume / "hub", "org/name", model_files(tmp_path, "old", '{"v": 1}'))
    link = fetch_model("org/name", "", volume / "model", volume / "hub")
    assert link.is_symlink() and not Path(os.readlink(link)).is_absolute()  # any mount
    assert (link / "config.json").read_text() == '{"v": 1}'
    add_to_cache(volume / "hub", "org/name", model_files(tmp_path, "new", '{"v": 2}'))
    fetch_model("org/name", "", volume / "model", volume / "hub")  # main moved on
    assert (link / "config.json").read_text() == '{"v": 2}'
    assert sorted(p.name for p in volume.iterdir()) == ["hub", "model"]  # no leftovers
