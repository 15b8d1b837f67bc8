"""Prefix caching (DESIGN 4.12): multi-turn chats behind one shared system prompt, with
prefix caching on and off, through the engine (a verifier with its drafter in process,
speculative, the demo model on CPU).

Workload: --chats conversations run at once, each --turns turns. A turn's prompt is the
shared system prompt (--system tokens), the conversation so far (earlier user messages and
the replies the engine generated) and a new user message (--user tokens); it asks for
--reply tokens (ignore_eos). A chat sends its next turn when the reply is complete (closed
loop), so later turns find the system prompt and their own history cached. Token ids are
drawn at random from the vocabulary (seeded), the same in both runs.

Measured per run: TTFT (request added -> first token out of `step()`), p50 and p90, and
throughput (reply tokens over the run's wall time). The runs take turns (off, on, off, on
...) --repeats times on a shared 2-core box; the report gives the medians, the ratios
(off / on for TTFT, on / off for throughput) and checks that every reply is the same
token for token with caching on and off.

With --url OFF_URL ON_URL the same chats go through two running `chainspec serve`
gateways instead (one started with --no-enable-prefix-caching), streamed
`/v1/completions` with token-id prompts, one thread per chat; TTFT is send to the first
text chunk, and a reply's text is tokenized again (the demo tokenizer) for the next turn.

With --serve the script starts those two stacks itself (`chainspec serve`, each on its
own embedded Ray, namespace and state directory), on --model or, by default, a copy of the
demo checkpoint with `max_position_embeddings` raised (--positions; the weights are
links): Llama's RoPE has no learned position table, so the weights take any length, but
the demo was trained on 512 positions and its acceptance may fall past them (reported).
It reports, besides, the counters the run moved: the verifiers' prefix cache under vLLM's
names (the gateway's `vllm:prefix_cache_*`), the drafters' MTP KV cache
(`chainspec_drafter_prefix_cache_*`) and the spec-decode acceptance.

With --hybrid the model is a random Qwen3.5 (Gated DeltaNet + full attention, one MTP
layer) of the demo model's width, written to a temporary directory: its hits start from
the recurrent-state snapshots at block boundaries (engine/state_snapshots.py).

Usage: python benchmarks/prefix_cache.py [--chats 4] [--turns 4] [--system 1000]
       [--hybrid] [--url http://127.0.0.1:8001 http://127.0.0.1:8002]
       [--serve [--model DIR] [--positions 2048]]
Writes benchmarks/results/prefix_cache[_serve|_hybrid].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from chainspec.engine.local import LocalOptions, build_verifier, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.sampling import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {"ttft_p50_ratio": 3.0, "throughput_ratio": 1.5}  # issue 23


def hybrid_checkpoint(path: Path, max_len: int) -> Path:
    """A random Qwen3.5 of the demo model's width: 12 layers (9 GDN, 3 full), one MTP
    layer. NOTE: built with the tests' checkpoint writer (transformers' own model)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.unit.families.qwen3_5_checkpoint import write_checkpoint
    write_checkpoint(path, seed=0, vocab_size=2048, hidden_size=128, intermediate_size=352,
                     num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=32, linear_value_head_dim=32,
                     max_position_embeddings=max_len)
    return path


def workload(args, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    """The system prompt and each chat's user messages."""
    rng = random.Random(args.seed)
    system = [rng.randrange(1, vocab) for _ in range(args.system)]
    users = [[[rng.randrange(1, vocab) for _ in range(args.user)] for _ in range(args.turns)]
             for _ in range(args.chats)]
    return system, users


def run(engine, system: list[int], users, reply: int) -> dict:
    """Every chat to its last turn; TTFTs, replies and the wall time."""
    history = [list(system) for _ in users]
    turn = [0] * len(users)
    added: dict[str, float] = {}
    ttft: list[float] = []
    replies: dict[str, list[int]] = {}
    stop = StopConditions(max_tokens=reply, ignore_eos=True)

    def submit(chat: int) -> None:
        rid = f"c{chat}t{turn[chat]}"
        history[chat] += users[chat][turn[chat]]
        engine.add_request(rid, history[chat], SamplingParams(temperature=0.0), stop)
        added[rid], replies[rid] = time.perf_counter(), []

    t0 = time.perf_counter()
    for chat in range(len(users)):
        submit(chat)
    cached = prompt = 0
    while engine.has_work:
        for out in engine.step():
            toks = replies[out.request_id]
            if not toks and out.new_tokens:
                ttft.append(time.perf_counter() - added[out.request_id])
            toks.extend(out.new_tokens)
            if not out.finished:
                continue
            chat = int(out.request_id[1:].split("t")[0])
            cached += out.stats.cached_tokens
            prompt += len(history[chat])
            history[chat] += toks
            turn[chat] += 1
            if turn[chat] < len(users[chat]):
                submit(chat)
    wall = time.perf_counter() - t0
    tokens = sum(len(t) for t in replies.values())
    ttft.sort()
    return {"wall_s": wall, "tokens": tokens, "throughput_tok_s": tokens / wall,
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * len(ttft))],
            "cached_prompt_tokens": cached, "prompt_tokens": prompt, "replies": replies,
            "resyncs": engine.resyncs}


def run_http(url: str, system: list[int], users, reply: int, model_dir: Path) -> dict:
    """The chats through a gateway at `url`, one thread per chat."""
    import concurrent.futures

    import httpx

    from chainspec.models.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(model_dir)

    def turn(client: httpx.Client, prompt: list[int]) -> tuple[float, str, dict]:
        body = {"prompt": prompt, "max_tokens": reply, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        t0, ttft, text, usage = time.perf_counter(), None, [], {}
        with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                event = json.loads(line[5:])
                piece = "".join(c.get("text", "") for c in event.get("choices") or ())
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
                usage = event.get("usage") or usage
        return ttft, "".join(text), usage

    def chat(c: int) -> tuple[list[float], list[str], int, int]:
        history, ttfts, texts, cached, tokens = list(system), [], [], 0, 0
        with httpx.Client(base_url=url, timeout=600) as client:
            for user in users[c]:
                history += user
                ttft, text, usage = turn(client, history)
                ttfts.append(ttft)
                texts.append(text)
                tokens += usage.get("completion_tokens", 0)
                cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                history += tok.encode(text, add_special_tokens=False)
        return ttfts, texts, cached, tokens

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(users)) as pool:
        done = list(pool.map(chat, range(len(users))))
    wall = time.perf_counter() - t0
    ttft = sorted(t for d in done for t in d[0])
    tokens = sum(d[3] for d in done)
    return {"wall_s": wall, "tokens": tokens, "throughput_tok_s": tokens / wall,
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * len(ttft))],
            "cached_prompt_tokens": sum(d[2] for d in done), "prompt_tokens": 0,
            "replies": {f"c{c}": d[1] for c, d in enumerate(done)}, "resyncs": "n/a"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=1000)
    p.add_argument("--user", type=int, default=24)
    p.add_argument("--reply", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hybrid", action="store_true",
                   help="a random Qwen3.5 (GDN states snapshotted) instead of the demo model")
    p.add_argument("--url", nargs=2, metavar=("OFF_URL", "ON_URL"),
                   help="gateways of two running stacks, caching off and on")
    p.add_argument("--serve", action="store_true",
                   help="start the two stacks (chainspec serve, caching off and on)")
    p.add_argument("--model", type=Path,
                   help="--serve: the model directory (default: the demo, --positions long)")
    p.add_argument("--positions", type=int, default=2048,
                   help="--serve: max_position_embeddings of the demo's copy")
    p.add_argument("--drafters", type=int, default=1,
                   help="--serve: drafter actors of each stack (hits then need the drafter "
                        "that cached their blocks)")
    args = p.parse_args(argv)
    if args.url or args.serve:
        return main_http(args, argv)
    torch.set_num_threads(1)
    max_len = args.system + args.turns * (args.user + args.reply) + 64
    model = {}
    if args.hybrid:
        model = {"model_dir": hybrid_checkpoint(Path(tempfile.mkdtemp()), max_len),
                 "dtype": "float32"}
    opts = {on: LocalOptions(max_seqs=args.chats, max_len=max_len, enable_prefix_caching=on,
                             **model) for on in (False, True)}
    models = load_models(opts[True], speculative=True)
    system, users = workload(args, models.target.config.vocab_size)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.repeats):
        for on in (False, True):
            engine = build_verifier(models, opts[on], speculative=True)
            runs[on].append(run(engine, system, users, args.reply))
    report = summarize(args, argv, runs)
    name = "prefix_cache_hybrid" if args.hybrid else "prefix_cache"
    if args.hybrid:
        report["engine"] = ("VerifierEngine + in-process drafter (random Qwen3.5: 9 GDN + 3 "
                            "full-attention layers, width 128, one MTP layer; K=3, CPU, fp32, "
                            "1 thread)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(report))
    print(json.dumps(report, indent=2))
    return 0 if report["identical"] else 1


def main_http(args, argv) -> int:
    from chainspec.engine.local import DEMO_MODEL
    model_dir = args.model or DEMO_MODEL
    with tempfile.TemporaryDirectory(prefix="prefix_cache_") as tmp:
        if args.serve:
            if args.model is None:
                model_dir = long_demo(Path(tmp) / "model", args.positions)
            max_len = args.system + args.turns * (args.user + 2 * args.reply) + 64
            with Stack(model_dir, max_len, False, args, Path(tmp) / "off") as off, \
                    Stack(model_dir, max_len, True, args, Path(tmp) / "on") as on:
                before = {False: off.counters(), True: on.counters()}
                runs = run_sides(args, (off.url, on.url), model_dir)
                moved = {side: counters_minus(stack.counters(), before[side == "on"])
                         for side, stack in (("off", off), ("on", on))}
        else:
            runs = run_sides(args, args.url, model_dir)
    report = summarize(args, argv, runs)
    report["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    served = "the model below" if args.serve else "demo model"
    report["engine"] = (f"`chainspec serve` (Ray: verifier + {args.drafters} remote drafter "
                        f"actor(s), gateway; {served}, K=3, CPU), streamed /v1/completions")
    if args.serve:
        report["counters"] = moved
        for side in ("off", "on"):  # over every repeat, from the verifiers' counter
            report[side]["resyncs"] = int(moved[side]["chainspec_draft_resyncs"])
        report["model"] = (str(args.model) if args.model else
                           f"the demo checkpoint, max_position_embeddings "
                           f"{args.positions} (trained on 512)")
        report["drafters"] = args.drafters
    name = "prefix_cache_serve" + (f"_{args.drafters}_drafters" if args.drafters != 1 else "")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(report))
    print(json.dumps(report, indent=2))
    return 0 if report["identical"] else 1


def run_sides(args, urls, model_dir: Path) -> dict[bool, list[dict]]:
    """--repeats runs on each gateway, off and on taking turns."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(args.repeats):
        # NOTE: fresh prompts each repeat: a running stack keeps what earlier ones cached
        system, users = workload(argparse.Namespace(**{**vars(args), "seed": args.seed + r}),
                                 vocab)
        for on, url in ((False, urls[0]), (True, urls[1])):
            runs[on].append(run_http(url, system, users, args.reply, model_dir))
    return runs


def long_demo(path: Path, positions: int) -> Path:
    """The demo checkpoint with `max_position_embeddings` = `positions` (its files linked)."""
    from chainspec.engine.local import DEMO_MODEL
    path.mkdir(parents=True)
    for f in DEMO_MODEL.iterdir():
        if f.name != "config.json":
            (path / f.name).symlink_to(f)
    config = json.loads((DEMO_MODEL / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config,
                                                  "max_position_embeddings": positions}))
    return path


# the counters a run moves: verifiers' prefix cache under vLLM's names (the gateway's
# /metrics), the drafters' MTP KV cache and the verifiers' acceptance (their own /metrics)
GATEWAY_COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")
MEMBER_COUNTERS = {"drafter": ("chainspec_drafter_prefix_cache_queries",
                               "chainspec_drafter_prefix_cache_hits"),
                   "verifier": ("chainspec_spec_decode_num_drafts",
                                "chainspec_spec_decode_num_draft_tokens",
                                "chainspec_spec_decode_num_accepted_tokens",
                                "chainspec_plain_decode_fallbacks",
                                "chainspec_draft_resyncs",
                                "chainspec_draft_prefix_affine")}


class Stack:
    """`chainspec serve` on the model, caching on or off, on an embedded Ray of its own;
    stopped (SIGINT: the gateway, then the stack and its Ray) on exit."""

    def __init__(self, model_dir: Path, max_len: int, caching: bool, args, state: Path):
        state.mkdir(parents=True)
        self.log = state / "serve.log"
        name = "on" if caching else "off"
        self.cmd = [sys.executable, "-m", "chainspec.cli", "serve", "--model",
                    str(model_dir), "--max-model-len", str(max_len), "--port", "0",
                    "--max-num-seqs", str(max(args.chats, 8)),
                    "--namespace", f"prefix_cache_{name}_{os.getpid()}",
                    "--drafters", str(args.drafters),
                    "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
        self.env = {**os.environ, "CHAINSPEC_STATE_DIR": str(state)}
        self.url = ""

    def __enter__(self) -> Stack:
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while not self.url:
            found = re.search(r"is serving .* at (http://\S+) ", self.log.read_text())
            self.url = found.group(1) if found else ""
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"chainspec serve did not start:\n{self.log.read_text()}")
            time.sleep(0.5)
        return self

    def __exit__(self, *_) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def counters(self) -> dict[str, float]:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        def read(url: str, names) -> dict[str, float]:
            out = dict.fromkeys(names, 0.0)
            for family in text_string_to_metric_families(httpx.get(url).text):
                if family.name in out:
                    out[family.name] += sum(s.value for s in family.samples
                                            if s.name.endswith("_total"))
            return out
        got = read(f"{self.url}/metrics", GATEWAY_COUNTERS)
        groups = httpx.get(f"{self.url}/v1/metrics/targets").raise_for_status().json()
        for role, names in MEMBER_COUNTERS.items():
            for g in groups:
                if g["labels"].get("role") != role:
                    continue
                for target in g["targets"]:
                    path = g["labels"].get("__metrics_path__", "/metrics")
                    for k, v in read(f"http://{target}{path}", names).items():
                        got[k] = got.get(k, 0.0) + v
        return got


def counters_minus(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 1) for k, v in after.items()}


def summarize(args, argv, runs: dict[bool, list[dict]]) -> dict:
    def med(on: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs[on])
    identical = all(off["replies"] == on["replies"]
                    for off, on in zip(runs[False], runs[True], strict=True))
    side = {("on" if on else "off"): {
        "ttft_p50_ms": round(1e3 * med(on, "ttft_p50_s"), 1),
        "ttft_p90_ms": round(1e3 * med(on, "ttft_p90_s"), 1),
        "throughput_tok_s": round(med(on, "throughput_tok_s"), 1),
        "wall_s": [round(r["wall_s"], 2) for r in runs[on]],
        "cached_prompt_tokens": runs[on][0]["cached_prompt_tokens"],
        "prompt_tokens": runs[on][0]["prompt_tokens"],
        "resyncs": runs[on][0]["resyncs"]} for on in (False, True)}
    return {
        "command": "python benchmarks/prefix_cache.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "chats": args.chats, "turns": args.turns, "system_tokens": args.system,
        "user_tokens": args.user, "reply_tokens": args.reply, "repeats": args.repeats,
        "engine": "VerifierEngine + in-process drafter (demo model, K=3, CPU, 1 thread)",
        **side,
        "ttft_p50_ratio": round(side["off"]["ttft_p50_ms"] / side["on"]["ttft_p50_ms"], 2),
        "throughput_ratio": round(side["on"]["throughput_tok_s"] /
                                  side["off"]["throughput_tok_s"], 2),
        "targets": TARGETS, "identical": identical}


def markdown(r: dict) -> str:
    rows = "".join(
        f"| {name} | {r[name]['ttft_p50_ms']} | {r[name]['ttft_p90_ms']} | "
        f"{r[name]['throughput_tok_s']} | {r[name]['cached_prompt_tokens']}"
        f"{' of ' + str(r[name]['prompt_tokens']) if r[name]['prompt_tokens'] else ''} | "
        f"{r[name]['resyncs']} |\n" for name in ("off", "on"))
    met = {k: r[k] >= v for k, v in r["targets"].items()}
    return (
        "# Prefix caching: multi-turn chats behind a shared system prompt\n\n"
        f"`{r['command'].strip()}`\n\n"
        f"{r['engine']}; {r['chats']} chats at once, {r['turns']} turns each; a turn's prompt "
        f"is the {r['system_tokens']}-token system prompt, the chat so far and a "
        f"{r['user_tokens']}-token user message; replies of {r['reply_tokens']} tokens, "
        f"greedy. Medians of {r['repeats']} runs each, on and off taking turns.\n\n"
        "| prefix caching | TTFT p50 (ms) | TTFT p90 (ms) | throughput (tok/s) | "
        "prompt tokens cached (first run) | drafter resyncs |\n|---|---|---|---|---|---|\n" + rows +
        f"\nTTFT p50 {r['ttft_p50_ratio']}x lower (target >= "
        f"{r['targets']['ttft_p50_ratio']}: {'met' if met['ttft_p50_ratio'] else 'not met'}),"
        f" throughput {r['throughput_ratio']}x (target >= {r['targets']['throughput_ratio']}: "
        f"{'met' if met['throughput_ratio'] else 'not met'}). Replies identical on and off: "
        f"{'yes' if r['identical'] else 'NO'}.\n" + counters_markdown(r))


def counters_markdown(r: dict) -> str:
    """The counters the run moved on each stack (--serve), and the load."""
    out = f"\nLoad average (1, 5, 15 min) at the end: {r['load_avg']}.\n" \
        if "load_avg" in r else ""
    if "counters" not in r:
        return out
    names = [("vllm:prefix_cache_queries", "verifier `vllm:prefix_cache_queries`"),
             ("vllm:prefix_cache_hits", "verifier `vllm:prefix_cache_hits`"),
             ("chainspec_drafter_prefix_cache_queries",
              "drafter `chainspec_drafter_prefix_cache_queries`"),
             ("chainspec_drafter_prefix_cache_hits",
              "drafter `chainspec_drafter_prefix_cache_hits`"),
             ("chainspec_spec_decode_num_drafts", "verify rounds with drafts"),
             ("chainspec_spec_decode_num_draft_tokens", "draft tokens"),
             ("chainspec_spec_decode_num_accepted_tokens", "accepted tokens"),
             ("chainspec_plain_decode_fallbacks", "plain-decode fallbacks"),
             ("chainspec_draft_resyncs", "drafter resyncs"),
             ("chainspec_draft_prefix_affine", "hits sent to the drafter holding them")]
    c = r["counters"]
    rows = "".join(f"| {label} | {c['off'][k]:g} | {c['on'][k]:g} |\n" for k, label in names)
    mean = {side: 1 + c[side]["chainspec_spec_decode_num_accepted_tokens"] /
            max(c[side]["chainspec_spec_decode_num_drafts"], 1) for side in ("off", "on")}
    return (f"\nModel: {r['model']}.\n\nCounters the run moved (after - before, over "
            "every repeat; the gateway's /metrics and the members' it lists at "
            "/v1/metrics/targets):\n\n| counter | caching off | caching on |\n|---|---|---|\n"
            + rows + f"| tokens per verify round (1 + accepted / rounds) | "
            f"{mean['off']:.2f} | {mean['on']:.2f} |\n" + out)


if __name__ == "__main__":
    raise SystemExit(main())
