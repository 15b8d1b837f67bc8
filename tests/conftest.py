"""Test-session settings shared by every suite."""

import os

import torch

# Tests run small shapes on 2 cores: one intra-op thread is faster and keeps timings steady.
torch.set_num_threads(int(os.environ.get("CHAINSPEC_TEST_THREADS", "1")))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
