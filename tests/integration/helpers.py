"""Helpers for service tests: a background event loop, Generate calls, plain references."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from chainspec.engine.local import LocalOptions, build_verifier, load_models
from chainspec.engine.request import StopConditions
from chainspec.engine.runner import run_to_completion
from chainspec.engine.sampling import SamplingParams
from chainspec.models.tokenizer import Tokenizer
from chainspec.rpc.generated.v1 import verifier_pb2 as pb
from chainspec.rpc.generated.v1 import verifier_pb2_grpc as pb_grpc


class LoopThread:
    """An asyncio loop on a daemon thread; `run(coro)` from the test thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro):
        """Start `coro` on the loop; returns its concurrent future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def wait_for(predicate: Callable[[], object], timeout: float, what: str,
             describe: Callable[[], object] = lambda: "") -> object:
    """The predicate's first truthy value within `timeout` s, else an AssertionError naming
    `what` (and `describe()`, e.g. the stack's members)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} {describe()}")


class Process:
    """A long-running command (a `chainspec ...` process) and its output so far."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, needle: str, timeout: float) -> None:
        """Until `needle` is printed; fails (with the output) if the process exits first."""
        wait_for(lambda: needle in self.output() or self.proc.poll() is not None, timeout,
                 repr(needle))
        assert self.proc.poll() is None, self.output()


def start_serve(model_dir: Path, namespace: str, *extra: str) -> Process:
    """`chainspec serve` on the session's Ray in `namespace` with a free HTTP port (`.url`),
    once it says it serves."""
    import os
    import socket
    import sys

    import ray
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    served = Process([sys.executable, "-m", "chainspec.cli", "serve", "--model", str(model_dir),
                      "--address", ray.get_runtime_context().gcs_address,
                      "--namespace", namespace, "--port", str(port), "--max-len", "256",
                      "--timeout", "240", *extra], dict(os.environ))
    served.url = f"http://127.0.0.1:{port}"
    served.wait_for("Ctrl-C stops it.", 240)
    return served


def stop_serve(served: Process, namespace: str, timeout: float = 90) -> None:
    """SIGTERM a `chainspec serve` and wait; `chainspec down` only when it did not say
    that it stopped its stack. NOTE: serve says `[ 4.2s] stopped` once its stack is down
    (never "stack stopped", which is `up`'s line): a `down` after it is a fresh CLI
    process, 3-9 s here, that finds nothing to stop."""
    if served.proc.poll() is None:
        served.proc.terminate()
        served.proc.wait(timeout)
    served.reader.join(10)  # its last lines
    if not any(line.endswith("] stopped") for line in served.lines):
        cli(namespace, "down")


def cli(namespace: str, *args: str) -> subprocess.CompletedProcess:
    """`chainspec <args> --namespace <namespace>` in a fresh process."""
    import os
    import sys
    return subprocess.run([sys.executable, "-m", "chainspec.cli", *args,
                           "--namespace", namespace], capture_output=True, text=True,
                          timeout=180, env=os.environ)


@dataclass
class Generated:
    tokens: list[int]
    text: str
    finished: pb.GenerateFinished


def generate(stub: pb_grpc.VerifierStub, prompt: Sequence[int] | str, max_tokens: int = 24,
             timeout: float = 60.0, **fields) -> Generated:
    fields.setdefault("stop", pb.StopConditions(max_tokens=max_tokens, ignore_eos=True))
    req = pb.GenerateRequest(**fields)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.tokens.ids.extend(prompt)
    tokens, text, finished = [], "", None
    for msg in stub.Generate(req, timeout=timeout):
        if msg.HasField("chunk"):
            tokens.extend(msg.chunk.token_ids)
            text += msg.chunk.text
        else:
            finished = msg.finished
    return Generated(tokens, text, finished)


def verifier_stub(endpoint: str) -> tuple[grpc.Channel, pb_grpc.VerifierStub]:
    channel = grpc.insecure_channel(endpoint)
    return channel, pb_grpc.VerifierStub(channel)


PROMPTS = ["def fibonacci(n):", "hello world", "€ 你好 🙂", "for i in range(3):",
           "The quick brown fox", "a", "print(i * i)", "lazy dog jumps"]


def prompt_ids(model_dir: Path, n: int = 8) -> list[list[int]]:
    tok = Tokenizer.from_dir(model_dir)
    return [tok.encode(p) for p in (PROMPTS * (n // len(PROMPTS) + 1))[:n]]


def plain_outputs(model_dir: Path, prompts: Sequence[Sequence[int]], max_tokens: int = 24,
                  num_steps: int = 3) -> list[list[int]]:
    """Greedy tokens of an in-process verifier engine without a drafter."""
    opts = LocalOptions(model_dir=model_dir, num_steps=num_steps, max_seqs=8, max_len=256)
    engine = build_verifier(load_models(opts, speculative=False), opts, speculative=False)
    result = run_to_completion(engine, prompts, SamplingParams(temperature=0.0),
                               StopConditions(max_tokens=max_tokens, ignore_eos=True))
    return [c.tokens for c in result.completions]


class LoadGenerator:
    """`workers` threads sending Generate calls round-robin over `prompts` until stopped;
    every result is checked against `expected` (same index) as it completes."""

    def __init__(self, stub: pb_grpc.VerifierStub, prompts: Sequence[Sequence[int]],
                 expected: Sequence[Sequence[int]], max_tokens: int, workers: int = 4) -> None:
        self.stub, self.prompts, self.expected = stub, prompts, expected
        self.max_tokens = max_tokens
        self.done = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, args=(w,), daemon=True)
                         for w in range(workers)]
        for t in self._threads:
            t.start()

    def _work(self, worker: int) -> None:
        i = worker
        while not self._stop.is_set():
            k = i % len(self.prompts)
            try:
                got = generate(self.stub, self.prompts[k], self.max_tokens)
                problem = None if got.tokens == list(self.expected[k]) else \
                    f"prompt {k}: output differs from plain decoding"
            except grpc.RpcError as e:
                problem = f"prompt {k}: {e.code().name}: {e.details()}"
            with self._lock:
                self.done += 1
                if problem:
                    self.failures.append(problem)
            i += len(self._threads)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


def stack_verifier(namespace: str) -> dict:
    """The verifier member of the stack in `namespace`, as `stack.status` shows it."""
    from chainspec.cluster import stack
    return next(m for m in stack.status(namespace=namespace) if m["role"] == "verifier")


def ready_tp_verifier(namespace: str, pids_not=frozenset(), ranks: int = 2) -> dict:
    """Wait for a ready verifier of `ranks` live ranks, none of them in `pids_not` (a
    group that came back has new ranks)."""
    from chainspec.cluster import stack

    def ready():
        v = stack_verifier(namespace)
        got = v.get("ranks") or []
        ok = v["state"] == "ready" and len(got) == ranks and \
            all(r["state"] == "alive" and r["pid"] not in pids_not for r in got)
        return v if ok else None
    return wait_for(ready, 120, f"a ready TP={ranks} verifier",
                    lambda: stack.status(namespace=namespace))
