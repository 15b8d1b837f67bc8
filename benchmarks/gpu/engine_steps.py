"""Timed engine steps on the demo model: a draft round (CUDA graph vs eager, per bucket)
and a verify step (per batch size; graph vs eager once captured verify steps exist)."""

from __future__ import annotations

import importlib.util
import inspect
import math
import random

import torch

from benchmarks.gpu.timing import Budget, Context, each_size, median_ms, skipped
from chainspec.engine.draft_batch import Window
from chainspec.engine.draft_step import draft_round
from chainspec.engine.graph_runner import GraphRunner, StaticDraftBuffers, default_buckets
from chainspec.engine.local import DEMO_MODEL
from chainspec.engine.request import Request, StopConditions
from chainspec.engine.sampling import SamplingParams
from chainspec.engine.schedule import Work, WorkKind
from chainspec.engine.verify_batch import run_verify
from chainspec.models import kv_cache
from chainspec.models.loader import load_draft_model, load_target

K = 3  # draft steps (the demo model has 3 MTP modules)
VERIFY_GRAPHS = "chainspec.engine.verify_graphs"
BLOCK = 16  # block size of the paged cache
# NOTE: both KV layouts are served while the paged engine (branch `paged`) is on its way
# to main: slot caches (KVCache, Window.slot, Request.slot) and paged ones (ModelKVCache,
# Window.blocks, Request.blocks). Delete the slot branch of each helper once it merged.
PAGED = "block_size" in inspect.signature(StaticDraftBuffers.__init__).parameters


def _shape(ctx: Context) -> tuple[int, int, int]:
    """(largest batch, cache length, context) for the run."""
    return (2, 64, 40) if ctx.dry_run else (32, 512, 448)


def draft_round_section(ctx: Context, budget: Budget) -> dict:
    max_seqs, max_len, context = _shape(ctx)
    model = load_draft_model(DEMO_MODEL, ctx.dtype, ctx.device, cache_len=max_len)
    cfg = model.config

    def runner(use_graphs: bool) -> GraphRunner:
        cache = _kv_cache(K, max_seqs, max_len, cfg, ctx)
        paged = (BLOCK,) if PAGED else ()
        buffers = StaticDraftBuffers(max_seqs, K, cfg.hidden_size, max_len, *paged,
                                     ctx.device, ctx.dtype)
        # NOTE: depths 1 and K captured, as the drafter captures 1..K (drafter-side depth)
        r = GraphRunner(lambda b, d: draft_round(model, cache, b, d, True, 4), buffers,
                        default_buckets(max_seqs), use_graphs, (1, K))
        r.capture()
        return r

    graphs, eager = runner(True), runner(False)  # captured as the drafter does, outside

    @torch.inference_mode()  # as the engines run their steps
    def measure(batch: int) -> dict:
        wins = _windows(batch, context, max_len, cfg.hidden_size, cfg.vocab_size)
        same = torch.equal(graphs.run(wins).tokens, eager.run(wins).tokens) and \
            torch.equal(graphs.run(wins, 1).tokens, eager.run(wins, 1).tokens)
        e = median_ms(lambda: eager.run(wins), ctx)
        g = median_ms(lambda: graphs.run(wins), ctx)
        g1 = median_ms(lambda: graphs.run(wins, 1), ctx)  # a one-step round
        return {"batch": batch, "rows": batch * (K + 1), "eager_ms": e, "graph_ms": g,
                "graph_ms_depth1": g1, "speedup": e / g, "same_drafts": same}

    out = each_size(graphs.buckets, budget, measure)
    out.update(k=K, context=context, captured=bool(graphs.graphs), model="demo MTP",
               kv_layout="paged" if PAGED else "slots", dtype=str(ctx.dtype))
    return out


def _windows(batch: int, context: int, max_len: int, hidden: int, vocab: int
             ) -> list[Window]:
    """Steady-state update windows: K+1 new rows per sequence near `context`, sampled."""
    rng = random.Random(batch)
    return [Window(**_where(s, max_len), first_pos=context - rng.randint(0, 8),
                   hidden=torch.randn(K + 1, hidden), tokens=torch.randint(0, vocab, (K + 1,)),
                   temperature=0.7, seed=s) for s in range(batch)]


def _kv_cache(layers: int, max_seqs: int, max_len: int, cfg, ctx: Context):
    """Room for `max_seqs` sequences of `max_len` positions."""
    if PAGED:
        blocks = max_seqs * math.ceil(max_len / BLOCK)
        return kv_cache.ModelKVCache.uniform(layers, blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim,
                                     ctx.dtype, ctx.device)
    return kv_cache.KVCache(layers, max_seqs, max_len, cfg.num_kv_heads, cfg.head_dim,
                            ctx.dtype, ctx.device)


def _where(seq: int, max_len: int) -> dict:
    """Sequence `seq`'s place in the cache: its slot, or its own run of blocks."""
    if PAGED:
        width = math.ceil(max_len / BLOCK)
        return {"blocks": tuple(range(seq * width, (seq + 1) * width))}
    return {"slot": seq}


def verify_step_section(ctx: Context, budget: Budget) -> dict:
    max_seqs, max_len, context = _shape(ctx)
    model = load_target(DEMO_MODEL, ctx.dtype, ctx.device, cache_len=max_len)
    cfg = model.config
    cache = _kv_cache(cfg.num_layers, max_seqs, max_len, cfg, ctx)
    graph_step, captured = _verify_graph_step(model, cache, max_seqs, max_len, ctx) \
        or (None, False)

    @torch.inference_mode()
    def measure(batch: int) -> dict:
        work = _verify_work(batch, context, max_len, cfg.vocab_size)
        eager = run_verify(model, cache, work, ctx.device)
        e = median_ms(lambda: run_verify(model, cache, work, ctx.device), ctx)
        row = {"batch": batch, "rows": batch * (K + 1), "eager_ms": e,
               "rows_per_s": batch * (K + 1) / e * 1e3}
        if graph_step is not None:
            same = graph_step(work).verdicts == eager.verdicts
            g = median_ms(lambda: graph_step(work), ctx)
            row.update(graph_ms=g, speedup=e / g, same_verdicts=same)
        return row

    out = each_size(default_buckets(max_seqs), budget, measure)
    out.update(k=K, context=context, model="demo target", dtype=str(ctx.dtype),
               kv_layout="paged" if PAGED else "slots",
               graphs="captured" if captured else "static path, eager (CPU)" if graph_step
               else skipped(f"{VERIFY_GRAPHS} is not on main yet")["skipped"])
    return out


def _verify_work(batch: int, context: int, max_len: int, vocab: int) -> list[Work]:
    """One verify window per sequence: x[N] and K drafts at positions context..+K."""
    rng = random.Random(batch)
    work = []
    for s in range(batch):
        req = Request(f"r{s}", [rng.randrange(vocab) for _ in range(context)],
                      SamplingParams(temperature=0.0), StopConditions(), K)
        place = _where(s, max_len)
        if PAGED:
            req.blocks.blocks = list(place["blocks"])
        else:
            req.slot = place["slot"]
        req.num_computed = context
        tokens = tuple(rng.randrange(vocab) for _ in range(K + 1))
        work.append(Work(req, WorkKind.VERIFY, context, tokens, K))
    return work


def _verify_graph_step(model, cache, max_seqs: int, max_len: int, ctx: Context):
    """`(work) -> StepResult` through captured verify steps (`VerifyGraphs`, its static
    path run eagerly on CPU), and whether it captured; None while it is not on main."""
    if importlib.util.find_spec(VERIFY_GRAPHS) is None:
        return None
    from chainspec.engine.verify_graphs import VerifyGraphs
    extra = {"static_on_cpu": ctx.dry_run} \
        if "static_on_cpu" in inspect.signature(VerifyGraphs).parameters else {}
    graphs = VerifyGraphs(model, cache, max_seqs=max_seqs, num_steps=K, max_len=max_len,
                          use_graphs=True, **extra)
    graphs.capture()
    return (lambda work: run_verify(model, cache, work, ctx.device, graphs=graphs)), \
        bool(graphs.graphs)
