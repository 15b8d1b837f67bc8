"""The demo trainer's arguments (`chainspec train-demo`, `python -m
chainspec.training.trainer`), apart from the trainer so that building the parser imports
no torch."""

from __future__ import annotations

import argparse
from pathlib import Path

from chainspec.training.recipe import PRESETS

DESCRIPTION = ("Train the demo model (Llama target + chained MTP modules) on the Python "
               "standard library and write a Hugging Face folder with a model card.")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chainspec train-demo", description=DESCRIPTION)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    p.add_argument("--joint-steps", type=int, help="override the joint stage's steps")
    p.add_argument("--distill-steps", type=int, help="override the distill stage's steps")
    p.add_argument("--stdlib", type=Path, help="corpus root (default: this Python's stdlib)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
