"""The README.md `chainspec train-mtp` writes beside the modules it trained."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from chainspec.training.model_card import acceptance_table, loss_table

if TYPE_CHECKING:
    from chainspec.training.train_mtp import MTPReport


def render(r: MTPReport) -> str:
    job, rec, s = r.job, r.job.recipe, r.job.settings
    sch, e, k = rec.schedule, s.eval, rec.num_mtp
    times = ", ".join(f"{name} {v / 60:.1f} min" for name, v in r.seconds.items())
    params = "\n".join(f"- {name}: {n:,}" for name, n in r.params.items())
    data = "\n".join(f"| {name} | {n:,} |" for name, n in r.data.items())
    resumed = (f" Resumed from the checkpoint of step {r.resumed_from}; times are this "
               "invocation's." if r.resumed_from else "")
    return f"""# MTP drafter for `{job.target.name}`

{k} chained multi-token-prediction modules (DeepSeek-V3 layout) trained by
`chainspec train-mtp` for the frozen target `{job.target}` ({r.architecture}). The
target's own files are linked or copied here unchanged; `mtp.safetensors` holds module i
as `model.layers.{{N+i}}.*` (N = the target's layer count) and `config.json` adds
`num_nextn_predict_layers: {k}`, so every chainspec command loads this folder as a
speculative model. Embedding and LM head are the target's, shared and not stored twice.

## Command

    {job.command}

Seed {rec.seed}; torch {torch.__version__}, Python {r.python}, device {s.device}
({s.threads} CPU threads), {'bf16 autocast' if s.bf16 else 'fp32'}. Wall time: {times}.{resumed}

## Data
`--data {job.data}`, split by document (`sha256(key) mod 100 < {rec.held_out_percent}`
is held out), tokenized with the target's tokenizer, documents joined by its BOS/EOS.

| | count |
|---|---:|
{data}

## Recipe
Self-distillation against the frozen target (target, embedding and head frozen): module k
at row p reads emb(x[p+k]) and g[k-1][p] (g[0] = the target's hidden state; chain mode)
and is trained with soft cross-entropy against the target's own distribution at row p+k.
{sch.steps} steps x {rec.grad_accum} batch(es) of {rec.batch_size} x {rec.seq_len}
tokens on each of {rec.workers} data parallel worker(s) ({rec.tokens_per_step:,}
tokens/step, {sch.steps * rec.tokens_per_step:,} in all); AdamW (0.9, 0.95), lr {sch.lr:g},
warmup {sch.warmup_steps}, cosine to {sch.min_lr_ratio:g}x, weight decay {sch.weight_decay:g},
grad clip {sch.grad_clip:g}.
Modules start from Normal(0, 0.02) (residual outputs scaled down), norms at 1.
{params}

## Losses
Train rows average the last log interval; the held-out row uses {e.loss_windows}
held-out windows. Target CE and MTP k CE are against the corpus; distill CE is against
the target's distribution (its entropy is the floor).

{loss_table(r.log, k)}

## Held-out acceptance (K = {k}, greedy, chain mode, stored weights)
- **Teacher-forced** over {e.windows} held-out windows ({r.teacher_forced.rounds:,}
  positions): draft k at row p is accepted when drafts 1..k equal the target's argmax at
  rows p+1..p+k given the true prefix.
- **Simulated self-speculation** on {r.simulated_prompts} held-out prompts
  ({e.prompt_len} tokens, {e.max_new_tokens} new tokens, {r.simulated.rounds} rounds):
  drafts from scratch each round, one target forward verifies them (greedy rule).

Mean acceptance length = 1 + sum_k P(k accepted), tokens committed per verify.

{acceptance_table(r.teacher_forced, r.simulated)}
"""
