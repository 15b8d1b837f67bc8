"""Arguments shared by commands that load a model in this process."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from chainspec.engine.local import DEMO_MODEL, DTYPES, LocalOptions


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=DEMO_MODEL,
                   help="Hugging Face model directory (default: the bundled demo model)")
    p.add_argument("-k", "--num-speculative-tokens", dest="k", type=int, default=3,
                   help="draft tokens per round (K)")
    p.add_argument("--no-chain", dest="chain", action="store_false",
                   help="every MTP step reads the target hidden state (non-chain mode)")
    p.add_argument("--max-seqs", type=int, default=8, help="most sequences running at once")
    p.add_argument("--max-len", type=int, default=1024, help="context length per sequence")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-memory", type=int, metavar="BYTES",
                    help="paged KV cache size in bytes (default: what --max-seqs sequences "
                         "of --max-len take)")
    kv.add_argument("--kv-cache-fraction", type=float, metavar="F",
                    help="paged KV cache as a share of free device memory (CUDA)")
    p.add_argument("--kv-block-size", type=int, default=16, help="positions per KV block")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a CPU, models of the demo's "
                        "size run fastest single-threaded; 0 keeps torch's default)")


def local_options(args: argparse.Namespace) -> LocalOptions:
    if getattr(args, "threads", 0) and not getattr(args, "dry_run", False):
        torch.set_num_threads(args.threads)
    return LocalOptions(args.model, args.k, args.chain, args.max_seqs, args.max_len,
                        args.dtype, args.device, args.kv_cache_memory, args.kv_cache_fraction,
                        args.kv_block_size)
