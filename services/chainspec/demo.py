"""`python -m chainspec.demo` (what `make demo` runs): the main job, end to end.

Starts the whole stack exactly as `chainspec serve` does (a local Ray, the controller,
one verifier, one drafter, the HTTP gateway), sends prompts through the OpenAI API with
the official `openai` client (one of them streamed), prints the completions with each
request's acceptance length, then compares speculative with plain decoding **on the same
stack**: it times the same greedy prompts, scales the drafters to 0 (what
`chainspec scale drafters 0` does; the verifier then decodes plainly), times them again,
and checks that the texts are identical. Then it stops everything.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from chainspec.bench import load_prompts
from chainspec.cluster.config import StackConfig
from chainspec.engine.local import DEMO_MODEL
from chainspec.gateway.config import GatewayConfig
from chainspec.serving.config import ServeConfig
from chainspec.serving.progress import Progress
from chainspec.serving.runner import ServingStack

NAMESPACE = "chainspec-demo"  # apart from a `chainspec serve` the user may be running


@dataclass
class Timed:
    text: str
    tokens: int
    seconds: float
    acceptance_length: float
    accepted: int
    drafted: int
    drafted_rounds: int


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"demo: no model at {args.model}; train it with `make train-demo` "
              f"or pass --model DIR", file=sys.stderr)
        return 1
    import openai

    config = ServeConfig(StackConfig(model_dir=str(args.model), namespace=NAMESPACE,
                                     max_len=args.max_len),
                         GatewayConfig(port=args.port))
    print(f"chainspec demo: {args.model.name} model, chained MTP speculation with K = "
          f"{config.stack.num_steps}, 1 verifier + 1 drafter on a local Ray\n")
    serving = ServingStack.start(config, Progress())
    try:
        client = openai.OpenAI(base_url=f"{serving.url}/v1", api_key="demo", max_retries=0)
        model = serving.model_name()
        print(f"\nthe OpenAI API is at {serving.url}/v1; from a shell:\n  "
              f"{serving.curl_example()}\n")
        prompts = load_prompts(args.model, args.prompts)
        _tour(client, model, prompts[:3], args.max_tokens)
        _streamed(client, model, prompts[0], args.max_tokens)
        _compare(serving, client, model, prompts, args.max_tokens)
    finally:
        print("\nstopping the gateway and the stack ...", flush=True)
        serving.stop()
    print("done.")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m chainspec.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEMO_MODEL, help="model directory")
    p.add_argument("--prompts", type=int, default=6, help="prompts in the speed comparison")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-len", type=int, default=512, help="context length per slot")
    p.add_argument("--port", type=int, default=0, help="gateway port (0: any free port)")
    return p


def _complete(client, model: str, prompt: str, max_tokens: int) -> Timed:
    t0 = time.perf_counter()
    out = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                    temperature=0, extra_body={"ignore_eos": True})
    seconds = time.perf_counter() - t0
    spec = out.usage.model_extra["speculative"]
    return Timed(out.choices[0].text, out.usage.completion_tokens, seconds,
                 spec["acceptance_length"], spec["accepted_tokens"], spec["draft_tokens"],
                 spec["rounds"] - spec["fallback_rounds"])


def _tour(client, model: str, prompts: list[str], max_tokens: int) -> None:
    print(f"== 1. completions (POST /v1/completions, greedy, {max_tokens} tokens) ==")
    for prompt in prompts:
        r = _complete(client, model, prompt, max_tokens)
        print(f"\n>>> {prompt!r}")
        print(textwrap.indent(prompt + r.text, "    "))
        print(f"    [{r.tokens} tokens in {r.seconds:.2f} s; acceptance length "
              f"{r.acceptance_length:.2f}: {r.accepted} of {r.drafted} drafted tokens accepted]")


def _streamed(client, model: str, prompt: str, max_tokens: int) -> None:
    print("\n== 2. a streamed chat completion (POST /v1/chat/completions, stream=true) ==\n")
    print(f"user: {prompt}\nassistant: ", end="", flush=True)
    usage = None
    for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], temperature=0,
            max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        usage = chunk.usage or usage
    spec = usage.model_extra["speculative"]
    print(f"\n    [{usage.completion_tokens} tokens streamed; acceptance length "
          f"{spec['acceptance_length']:.2f}]")


def _run_all(client, model: str, prompts: list[str], max_tokens: int) -> list[Timed]:
    return [_complete(client, model, p, max_tokens) for p in prompts]


def _compare(serving: ServingStack, client, model: str, prompts: list[str],
             max_tokens: int) -> None:
    print(f"\n== 3. speculative vs plain decoding, same stack, {len(prompts)} prompts one "
          f"at a time ==")
    _complete(client, model, prompts[0], 4)  # warm the path
    spec = _run_all(client, model, prompts, max_tokens)
    print("scaling the drafters to 0 (chainspec scale drafters 0) ...", flush=True)
    serving.scale_drafters(0)
    _complete(client, model, prompts[0], 4)
    plain = _run_all(client, model, prompts, max_tokens)
    rows = [("speculative (1 drafter)", spec), ("plain (0 drafters)", plain)]
    print(f"\n    {'':24} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'accept. length':>15}")
    for name, runs in rows:
        tokens, seconds = sum(r.tokens for r in runs), sum(r.seconds for r in runs)
        accepted, rounds = sum(r.accepted for r in runs), sum(r.drafted_rounds for r in runs)
        length = 1 + accepted / rounds if rounds else 1.0
        print(f"    {name:24} {tokens:7d} {seconds:8.2f} {tokens / seconds:9.1f} {length:15.2f}")
    speedup = sum(r.seconds for r in plain) / sum(r.seconds for r in spec)
    same = all(a.text == b.text for a, b in zip(spec, plain, strict=True))
    print(f"\n    speedup {speedup:.2f}x; identical text with and without drafts: "
          f"{'yes' if same else 'NO'} (the verifier decides every token)")
    if speedup < 1:
        print("    (here a draft round trip costs more than the accepted tokens save: on a "
              "few shared CPU cores\n    a target step is cheap; speculation pays when "
              "the target step dominates, e.g. a large model on a GPU)")


if __name__ == "__main__":
    sys.exit(main())
