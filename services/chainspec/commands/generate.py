"""`chainspec generate`: speculative (default) or plain generation in one process."""

from __future__ import annotations

import argparse

from chainspec.commands.model_args import TP_KEYS, add_model_args, local_options


def add_parser(sub) -> list[str]:
    p = sub.add_parser("generate", help="generate in one process (speculative by default)")
    add_model_args(p, TP_KEYS)
    p.add_argument("--prompt", action="append", required=True,
                   help="prompt text (repeat for a batch)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--no-spec", dest="spec", action="store_false",
                   help="plain decoding, no drafter")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--request-seed", type=int, default=None,
                   help="the requests' own seed (default: none; --seed seeds the engine's "
                        "draws for unseeded requests)")
    p.add_argument("--ignore-eos", action="store_true")
    return ["generate"]


def run(args: argparse.Namespace) -> int:
    from chainspec.engine.local import build_verifier, load_models
    from chainspec.engine.request import StopConditions
    from chainspec.engine.runner import merged_stats, run_to_completion
    from chainspec.engine.sampling import SamplingParams
    from chainspec.models.tokenizer import Tokenizer

    local = local_options(args)
    tok = Tokenizer.from_dir(local.model_dir)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.request_seed)
    stop = StopConditions(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    models = load_models(local, speculative=args.spec)
    engine = build_verifier(models, local, args.spec, tok.eos_token_ids, tok.decode)
    prompts = [tok.encode(p) for p in args.prompt]
    result = run_to_completion(engine, prompts, sampling, stop)
    for text, c in zip(args.prompt, result.completions, strict=True):
        print(text + tok.decode(c.tokens))
        print("-" * 60)
    mode = f"speculative (K={local.num_steps}, {'chain' if local.chain else 'non-chain'})" \
        if args.spec else "plain"
    n = result.generated_tokens
    print(f"mode: {mode}   tokens: {n}   time: {result.seconds:.2f} s   "
          f"{n / max(result.seconds, 1e-9):.1f} tok/s")
    if args.spec:
        s = merged_stats(result.completions, local.num_steps)
        rates = " ".join(f"{a / max(s.rounds, 1):.2f}" for a in s.accepted_per_pos)
        print(f"acceptance length: {s.acceptance_length:.2f} (accepted {s.accepted_tokens} of "
              f"{s.draft_tokens} drafted in {s.rounds} rounds; fallbacks {s.fallback_rounds})")
        print(f"accepted per position: {rates}")
    return 0
