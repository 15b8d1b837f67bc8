"""Integration fixtures: one tiny model directory, one background event loop for in-process
servers, and ONE local Ray per test session (started on first use, shut down at the end)."""

from __future__ import annotations

import os

import pytest

from chainspec.models.loader import load_draft_model, load_target
from tests import tools
from tests.integration.helpers import LoopThread
from tests.integration.tiny_checkpoint import write_tiny_model

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def openssl() -> str:
    """openssl, which makes the test certificates (skip, or fail under CI, without it)."""
    return tools.openssl()


@pytest.fixture(scope="module")
def models(model_dir):
    """The tiny target and its MTP draft model, loaded afresh for each test module."""
    return load_target(model_dir, cache_len=256), load_draft_model(model_dir, cache_len=256)


@pytest.fixture(scope="module")
def loop():
    """An event loop on a thread for one module's in-process servers."""
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="session")
def loop_thread():
    thread = LoopThread()
    yield thread
    thread.close()


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A local Ray for the whole session; stack state files go to a temp dir that CLI
    subprocesses inherit through the environment."""
    import ray

    state_dir = tmp_path_factory.mktemp("stack-state")
    os.environ["CHAINSPEC_STATE_DIR"] = str(state_dir)
    ctx = ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
                   namespace="chainspec-tests")
    yield ctx
    ray.shutdown()
