"""The demo model's README.md: how it was made and what it measures."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chainspec.training.evaluate import Acceptance
    from chainspec.training.stage import LogRow
    from chainspec.training.trainer import TrainReport


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def loss_table(rows: tuple[LogRow, ...], k: int) -> str:
    heads = " | ".join(f"MTP {i} CE" for i in range(1, k + 1))
    lines = [f"| step | stage | split | target CE | {heads} | distill CE (mean) |",
             "|---:|---|---|---:|" + "---:|" * (k + 1)]
    for r in rows:
        m = r.metrics
        mtp = " | ".join(f"{m[f'mtp{i}']:.3f}" for i in range(1, k + 1))
        soft = [m[f"distill{i}"] for i in range(1, k + 1) if f"distill{i}" in m]
        distill = f"{sum(soft) / len(soft):.3f}" if soft else "-"
        lines.append(f"| {r.step} | {r.stage} | {r.split} | {m['target']:.3f} | {mtp} | "
                     f"{distill} |")
    return "\n".join(lines)


def acceptance_table(tf: Acceptance, sim: Acceptance) -> str:
    lines = ["| draft position k | teacher-forced P(k accepted) | (conditional) | "
             "simulated P(k accepted) | (conditional) |", "|---:|---:|---:|---:|---:|"]
    for i in range(len(tf.rates)):
        lines.append(f"| {i + 1} | {tf.rates[i]:.3f} | {tf.conditional[i]:.3f} | "
                     f"{sim.rates[i]:.3f} | {sim.conditional[i]:.3f} |")
    lines.append(f"| **mean acceptance length** | **{tf.mean_length:.3f}** | | "
                 f"**{sim.mean_length:.3f}** | |")
    return "\n".join(lines)


def render(r: TrainReport) -> str:
    s, d, rec = r.recipe.shape, r.data, r.recipe
    files = "\n".join(f"- `{name}`: {_mb(size)}" for name, size in r.files.items())
    params = "\n".join(f"- {name}: {n:,}" for name, n in r.params.items())
    times = ", ".join(f"{k} {v / 60:.1f} min" for k, v in r.stage_seconds.items())
    e = rec.eval
    return f"""# chainspec demo model

A small Llama-architecture causal LM for Python source with {s.num_mtp} chained
multi-token-prediction (MTP) modules, trained by chainspec itself on this machine's CPU.
It is the default model of every chainspec command. It writes plausible-looking Python
and little else: it exists to exercise speculative decoding end to end, not to be useful.

## Files
{files}
- total (without this card): {_mb(sum(r.files.values()))}

`model.safetensors` is a plain `LlamaForCausalLM` checkpoint (tied embedding, so no
`lm_head.weight`): `transformers.AutoModelForCausalLM.from_pretrained(dir)` loads it and
reads no other weight file. `mtp.safetensors` holds MTP module i (i = 0..{s.num_mtp - 1}) in
DeepSeek-V3 naming as layer `model.layers.{{{s.num_layers}+i}}.*`: `enorm`, `hnorm`,
`eh_proj`, the decoder block directly under the layer prefix (`self_attn.*`, `mlp.*`,
`input_layernorm`, `post_attention_layernorm`) and `shared_head.norm`. The embedding and
LM head are shared with the target and stored once, in `model.safetensors`. Weights are
stored in bfloat16 (`torch_dtype` in `config.json`); all numbers below were measured with
the stored weights read back to float32.

## Command

    {r.command}

(`chainspec train-demo --out DIR` runs the same entry point.) Seed {rec.seed}; torch
{_torch()}, Python {r.python}, 2 CPU threads. Wall time of this run: {times}
(it grows when other work shares the cores).

## Data
The standard library of the training interpreter (Python {r.python}, `{r.stdlib_root}`):
every `*.py` file except those under `test/`, `tests/`, `idle_test/`, `site-packages/`,
and files over {rec.data.max_file_bytes:,} bytes. **File-level split**: a file is held out
when `sha256(relative path) mod 100 < {rec.data.held_out_percent}`.

| split | files | characters | tokens |
|---|---:|---:|---:|
| train | {d['train_files']} | {d['train_chars']:,} | {d['train_tokens']:,} |
| held-out | {d['held_out_files']} | {d['held_out_chars']:,} | {d['held_out_tokens']:,} |

Files are joined as `<|endoftext|> file <|endoftext|> file ...`; training draws random
windows of {rec.data.seq_len} tokens, {rec.data.batch_size} per step
({rec.data.seq_len * rec.data.batch_size:,} tokens/step). Tokens seen:
{(rec.joint.steps + rec.distill.steps) * rec.data.seq_len * rec.data.batch_size:,}.

## Tokenizer
Byte-level BPE (the `tokenizers` library, GPT-2 pre-tokenization), {s.vocab_size} tokens,
trained by the same command on the training split only. `<|endoftext|>` (id 0) is BOS
and EOS and separates files.

## Architecture
Target: Llama, {s.num_layers} layers, hidden {s.hidden_size}, {s.num_heads} heads
({s.num_kv_heads} KV heads, head dim {s.hidden_size // s.num_heads}), SwiGLU intermediate
{s.intermediate_size}, RoPE theta {s.rope_theta:g}, context {s.max_position}, tied
embedding. Each MTP module is one decoder layer of the same shape plus `enorm`, `hnorm`,
`eh_proj` ([emb, hidden] concat order) and a final norm; module k reads module k-1's block
output (chain mode). Deep and narrow on purpose: on a CPU a forward costs mostly per layer,
so a draft step (one layer + head) is cheap next to a {s.num_layers}-layer verify.
{params}

## Recipe
1. **Joint stage** ({rec.joint.steps} steps, DeepSeek-V3 MTP loss): L = CE_target +
   {rec.mtp_weight} * mean_k CE_k, where module k at row p sees emb(x[p+k]) and g[k-1][p]
   and predicts corpus token x[p+k+1]. AdamW (0.9, 0.95), lr {rec.joint.lr:g}, warmup
   {rec.joint.warmup_steps}, cosine to {rec.joint.min_lr_ratio:g}x, weight decay
   {rec.joint.weight_decay:g}, grad clip {rec.joint.grad_clip:g}, fp32.
2. **Distill stage** ({rec.distill.steps} steps, target frozen, embedding and head too):
   module k at row p is trained with soft cross-entropy against the frozen target's
   distribution at row p+k (given the true prefix). Greedy acceptance asks exactly
   "does draft k equal the target's argmax", so matching the target beats matching the
   corpus. lr {rec.distill.lr:g}, warmup {rec.distill.warmup_steps}, cosine, no weight decay.

## Loss curves
Train rows average the last log interval; held-out rows use {e.loss_windows} windows of
held-out files. MTP k CE is against the corpus token x[p+k+1]; distill CE is against the
target's distribution (its entropy is the floor).

{loss_table(r.log, s.num_mtp)}

## Held-out acceptance (K = {s.num_mtp}, greedy, chain mode)
- **Teacher-forced** over {e.windows} held-out windows ({r.teacher_forced.rounds:,}
  positions): at row p, draft k (inputs h[p] and the true tokens x[p+1..p+k]) is accepted
  when it equals the target's argmax at row p+k given the true prefix and drafts 1..k-1
  were accepted.
- **Simulated self-speculation** on {r.simulated_tokens} held-out prompts
  ({e.prompt_len} tokens each, {e.max_new_tokens} new tokens, {r.simulated.rounds}
  rounds): each round runs the {s.num_mtp} chained modules from scratch over the committed
  prefix (DESIGN 3.1) and verifies with one target forward (greedy rule, DESIGN 3.3).
  Its output equals plain greedy decoding by construction.

P(k accepted) is the fraction of rounds in which draft k was accepted (so 1..k all were);
mean acceptance length = 1 + sum_k P(k accepted), the tokens committed per verify.

{acceptance_table(r.teacher_forced, r.simulated)}

## Limitations
Tiny, briefly trained, code only, no instruction following. Greedy continuations of a
model this small repeat themselves readily, which the simulated figure includes; the
teacher-forced figure on real held-out text is the conservative one.
"""


def _torch() -> str:
    import torch

    return torch.__version__
