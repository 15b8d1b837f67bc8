"""Speculative decoding under a grammar (DESIGN 4.13) beside without one, in process.

The same held-out prompts, greedy, through a plain and a speculative engine built over the
same loaded demo model, for free text and for a few grammars (a JSON schema, regexes, a
choice). The speculative engine runs twice under a grammar: as built (the text the
grammar forces is drafted, `grammar_mask.guide_drafts`) and with the drafter's drafts
only. Reported per case: tokens/s, speculative over plain, acceptance length (tokens
committed per round with drafts), mean output length, the share of the speculative
engine's time spent on the grammar (drafts guided, masks filled, applied, settled), and
whether speculative output equals plain. Batches rotate between the engines so that
drift hits each alike. Free text runs to max_tokens (ignore_eos); grammars end with EOS.

    .venv/bin/python benchmarks/structured_output.py --batch-sizes 1 8 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from chainspec.bench import load_prompts
from chainspec.engine import grammar_mask, verifier
from chainspec.engine.grammar import GrammarCompiler, GrammarKind, GrammarSpec
from chainspec.engine.local import DEMO_MODEL, LocalOptions, build_verifier, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import merged_stats, run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.models.tokenizer import Tokenizer

OUT = Path(__file__).parent / "results"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "color": {"enum": ["red", "green", "blue"]}}, "required": ["name", "age", "color"]}
CASES = {
    "free text": None,
    "json_schema": GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)),
    "regex (a def line)": GrammarSpec(GrammarKind.REGEX, r"def [a-z_]{1,24}\([a-z_, ]{0,40}\):"),
    "regex (code, 2 lines)": GrammarSpec(GrammarKind.REGEX, r"[^\n]{1,60}\n[^\n]{1,60}\n"),
    "choice": GrammarSpec(GrammarKind.CHOICE, choices=("True", "False", "None")),
}


class GrammarClock:
    """Seconds spent in engine/grammar_mask.py (fill, apply, settle), cumulative."""

    def __init__(self) -> None:
        self.seconds = 0.0
        cls = grammar_mask.GrammarMasks
        for name in ("__init__", "apply", "settle"):
            setattr(cls, name, self._timed(getattr(cls, name)))
        self.guide = self._timed(verifier.guide_drafts)
        verifier.guide_drafts = self.guide

    def _timed(self, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("-k", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=str(OUT / "structured_output"))
    args = p.parse_args()
    torch.set_num_threads(1)
    opts = LocalOptions(DEMO_MODEL, num_steps=args.k, max_seqs=max(args.batch_sizes),
                        max_len=512)
    tok = Tokenizer.from_dir(DEMO_MODEL)
    models = load_models(opts, speculative=True)
    compiler = GrammarCompiler.for_tokenizer(tok, models.target.config.vocab_size,
                                             tok.eos_token_ids)
    engines = {"plain": build_verifier(models, opts, False, tok.eos_token_ids),
               "spec": build_verifier(models, opts, True, tok.eos_token_ids)}
    prompts = [tok.encode(t) for t in load_prompts(DEMO_MODEL, args.prompts)]
    clock = GrammarClock()
    rows = []
    for bs in args.batch_sizes:
        for case, spec in CASES.items():
            rows.append(run_case(engines, compiler, prompts, bs, case, spec, args, clock))
            print(json.dumps(rows[-1]))
    report = {"model": "demo", "k": args.k, "prompts": args.prompts,
              "max_tokens": args.max_tokens, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "rows": rows}
    Path(args.out + ".json").write_text(json.dumps(report, indent=1) + "\n")
    Path(args.out + ".md").write_text(markdown(report))


def run_case(engines, compiler, prompts, bs, case, spec, args, clock) -> dict:
    grammar = None if spec is None else compiler.compile(spec)
    params = SamplingParams(temperature=0.0, grammar=grammar)
    stop = StopConditions(max_tokens=args.max_tokens, ignore_eos=grammar is None)
    batches = [prompts[i:i + bs] for i in range(0, len(prompts), bs)]
    modes = ("plain", "spec") if grammar is None else ("plain", "spec", "unguided")
    for mode in modes:  # warm-up
        run_mode(engines, mode, batches[0], params, stop, clock)
    seconds, tokens = dict.fromkeys(modes, 0.0), dict.fromkeys(modes, 0)
    outputs = {m: [] for m in modes}
    completions, grammar_s = {m: [] for m in modes}, dict.fromkeys(modes, 0.0)
    for _ in range(args.repeats):
        for j, batch in enumerate(batches):
            for mode in modes[j % len(modes):] + modes[:j % len(modes)]:  # rotated
                before = clock.seconds
                r = run_mode(engines, mode, batch, params, stop, clock)
                seconds[mode] += r.seconds
                tokens[mode] += r.generated_tokens
                outputs[mode] += [c.tokens for c in r.completions]
                completions[mode] += r.completions
                grammar_s[mode] += clock.seconds - before
    tps = {m: tokens[m] / seconds[m] for m in modes}
    row = {"batch_size": bs, "case": case,
           "tokens_per_s": {m: round(v, 1) for m, v in tps.items()},
           "mean_tokens": round(tokens["spec"] / len(completions["spec"]), 1),
           "lossless": all(outputs[m] == outputs["plain"] for m in modes)}
    for m in modes[1:]:
        row[m] = {"speedup": round(tps[m] / tps["plain"], 3),
                  "acceptance_length": round(merged_stats(completions[m], args.k)
                                             .acceptance_length, 3),
                  "grammar_share": round(grammar_s[m] / seconds[m], 3)}
    return row


def run_mode(engines, mode, batch, params, stop, clock):
    """`unguided`: the speculative engine without drafting what the grammar forces."""
    verifier.guide_drafts = (lambda group: None) if mode == "unguided" else clock.guide
    return run_to_completion(engines["plain" if mode == "plain" else "spec"], batch, params,
                             stop)


def markdown(report: dict) -> str:
    lines = [f"# Speculative decoding under a grammar vs without (demo model, K={report['k']},"
             f" in process)", "",
             f"{report['prompts']} held-out prompts, greedy, at most {report['max_tokens']} "
             f"tokens, {report['repeats']} repeats interleaved, {report['threads']} thread; "
             f"`benchmarks/structured_output.py`. Free text runs to max_tokens (ignore_eos); "
             f"under a grammar output ends with EOS. `spec`: as built, drafting the text the "
             f"grammar forces; `drafter only`: the drafter's drafts alone. `grammar share`: "
             f"the speculative engine's time in the grammar (drafts guided, masks filled, "
             f"applied, settled).", "",
             "| batch | case | plain tok/s | spec tok/s | spec/plain | acceptance length | "
             "grammar share | drafter only: spec/plain | acceptance length | mean tokens | "
             "lossless |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        t, s, u = r["tokens_per_s"], r["spec"], r.get("unguided")
        only = f"{u['speedup']} | {u['acceptance_length']}" if u else "= spec | = spec"
        lines.append(f"| {r['batch_size']} | {r['case']} | {t['plain']} | {t['spec']} | "
                     f"{s['speedup']} | {s['acceptance_length']} | {s['grammar_share']} | "
                     f"{only} | {r['mean_tokens']} | {r['lossless']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
