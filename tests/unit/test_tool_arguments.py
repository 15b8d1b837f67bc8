"""Every bad argument of the tools (`bench serve`, `train-mtp`, `serve`) is refused before
any expensive work -- no request sent, no corpus or model loaded, no Ray started -- as one
line on stderr, exit code 2 and no traceback (issue 19, item 5); and every `--help` shows
each option's default."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from chainspec.cli import build_parser, main
from chainspec.commands.help_format import shows_default
from tests.integration.tiny_checkpoint import CORPUS, write_tiny_model

pytestmark = pytest.mark.timeout(120)


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """(exit code, stderr) of `chainspec argv...` in this process (argparse exits too)."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def assert_one_line_refusal(rc: int, err: str, expect: str) -> None:
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1, (rc, err)
    assert expect in lines[0], lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- bench serve

class FakeOpenAI:
    """/v1/models lists "fake", /health reports `drafters`; every completion is counted
    (a refused command must send none)."""

    def __init__(self, drafters: int | None = 1) -> None:
        self.completions = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                body = {"/v1/models": {"data": [{"id": "fake"}]},
                        "/health": {"drafters": drafters}}.get(self.path)
                self._send(200 if body else 404, body or {})

            def do_POST(self) -> None:
                fake.completions += 1
                self._send(500, {"error": "a refused command sent a request"})

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def fake():
    f = FakeOpenAI()
    yield f
    f.server.shutdown()


BENCH_CASES = [  # (extra argv, what the line must name); --base-url FAKE unless given
    (["--base-url", "127.0.0.1:8000"], "--base-url"),
    (["--base-url", "localhost:8000"], "--base-url"),
    (["--base-url", "http://127.0.0.1:8000/v1"], "/v1"),
    (["--base-url", "http://127.0.0.1:notaport"], "--base-url"),
    (["--base-url", "UNREACHABLE"], "cannot reach"),
    (["--stack-namespace", "no-such-stack"], "no-such-stack"),
    (["--compare-plain", "--stack-address", "127.0.0.1:1"], "stack"),
    (["--model-name", "other"], "'other' is not served"),
    ([], "load point"),  # neither --concurrency nor --request-rate
    (["--concurrency", "0"], "concurrency"),
    (["--concurrency", "1.5"], "integer"),
    (["--concurrency", "abc"], "--concurrency"),
    (["--request-rate", "nan"], "rate"),
    (["--request-rate", "-2"], "rate"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--num-prompts", "1e3"], "--num-prompts"),
    (["--warmup", "-1"], "--warmup"),
    (["--timeout", "0"], "--timeout"),
    (["--timeout", "nan"], "--timeout"),
    (["--idle-tail", "-1"], "--idle-tail"),
    (["--idle-tail", "nan"], "--idle-tail"),
    (["--idle-tail", "inf"], "--idle-tail"),
    (["--output-len", "0"], "--output-len"),
    (["--goodput", "ttft:abc"], "--goodput"),
    (["--goodput", "latency:5"], "--goodput"),
    (["--goodput", "ttft:-5"], "ttft"),
    (["--goodput", "e2e:nan"], "e2e"),
    (["--dataset", "random", "--random-range-ratio", "1"], "--random-range-ratio"),
    (["--dataset", "random", "--random-input-len", "0"], "--random-input-len"),
    (["--dataset", "jsonl"], "--dataset-path"),
    (["--dataset", "jsonl", "--dataset-path", "MISSING"], "--dataset-path"),
    (["--dataset-path", "MISSING"], "--dataset jsonl"),
    (["--dataset", "nope"], "--dataset"),
    (["--model-dir", "MISSING"], "held-out prompts"),
    (["--out", "UNDER_A_FILE"], "--out"),
]


@pytest.mark.parametrize("extra,expect", BENCH_CASES, ids=[" ".join(c[0]) or "no points"
                                                          for c in BENCH_CASES])
def test_bench_serve_refuses_bad_arguments_in_one_line(extra, expect, fake, tmp_path,
                                                       monkeypatch, capsys) -> None:
    monkeypatch.setenv("CHAINSPEC_STATE_DIR", str(tmp_path))  # no stack state files
    (tmp_path / "file").write_text("")
    subs = {"UNREACHABLE": f"http://127.0.0.1:{free_port()}", "MISSING": str(tmp_path / "x"),
            "UNDER_A_FILE": str(tmp_path / "file" / "out")}
    extra = [subs.get(a, a) for a in extra]
    points = [] if not extra or "--concurrency" in extra or "--request-rate" in extra \
        else ["--concurrency", "1"]
    argv = ["bench", "serve", "--base-url", fake.url, "--num-prompts", "2", "--no-plots",
            "--out", str(tmp_path / "out"), *points, *extra]
    before = fake.completions
    assert_one_line_refusal(*run_cli(argv, capsys), expect)
    assert fake.completions == before  # nothing was sent


def test_bench_serve_compare_plain_needs_drafters(tmp_path, capsys) -> None:
    plain = FakeOpenAI(drafters=None)  # an OpenAI server that is not a chainspec gateway
    try:
        rc, err = run_cli(["bench", "serve", "--base-url", plain.url, "--concurrency", "1",
                           "--compare-plain", "--out", str(tmp_path)], capsys)
        assert_one_line_refusal(rc, err, "--compare-plain")
        assert plain.completions == 0
    finally:
        plain.server.shutdown()


# ---------------------------------------------------------------- train-mtp

@pytest.fixture(scope="module")
def plain_target(tmp_path_factory) -> Path:
    folder = write_tiny_model(tmp_path_factory.mktemp("target"), num_mtp=1)
    (folder / "mtp.safetensors").unlink()
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["num_nextn_predict_layers"]
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture
def nothing_loads(monkeypatch):
    """A refused train-mtp must not reach the corpus or the model."""
    from chainspec.training import train_mtp

    def loaded(*args, **kwargs):
        raise AssertionError("train-mtp loaded a model or a corpus before refusing")
    monkeypatch.setattr(train_mtp, "build_model", loaded)
    monkeypatch.setattr(train_mtp, "prepare_data", loaded)


TRAIN_CASES = [  # (extra argv, what the line must name)
    (["--threads", "0"], "threads"),
    (["--threads", "-3"], "threads"),
    (["--device", "NO_GPU"], "--device"),
    (["--device", "tpu"], "--device"),
    (["--device", "cuda:999"], "--device"),
    (["--out", "UNDER_A_FILE"], "--out"),
    (["--out", "/proc/chainspec-unwritable"], "--out"),
    (["--out", "TARGET"], "--out"),
    (["--lr", "nan"], "lr"),
    (["--lr", "inf"], "lr"),
    (["--lr", "0"], "lr"),
    (["--seq-len", "1e9"], "--seq-len"),
    (["--seq-len", "1000000000"], "--seq-len"),
    (["--seq-len", "3"], "seq_len"),
    (["--steps", "0"], "untrained"),
    (["--steps", "-5"], "steps"),
    (["--warmup-steps", "-1"], "warmup_steps"),
    (["-k", "0"], "MTP module"),
    (["--batch-size", "0"], "batch_size"),
    (["--grad-accum", "0"], "grad_accum"),
    (["--workers", "0"], "workers"),
    (["--held-out-percent", "0"], "held_out_percent"),
    (["--held-out-percent", "100"], "held_out_percent"),
    (["--continue-tokens", "0"], "continue_tokens"),
    (["--checkpoint-every", "-1"], "checkpoint_every"),
    (["--log-every", "0"], "log_every"),
    (["--eval-windows", "0"], "evaluation"),
    (["--eval-prompts", "0"], "evaluation"),
    (["--eval-prompt-len", "1"], "prompt length"),
    (["--eval-new-tokens", "0"], "evaluation"),
    (["--eval-prompt-len", "500"], "--eval-prompt-len"),
    (["--data", "MISSING"], "--data"),
    (["--target", "MISSING"], "config.json"),
    (["--resume", "-k", "2"], "different recipe"),  # the checkpoint was written with K = 3
]


@pytest.mark.parametrize("extra,expect", TRAIN_CASES, ids=[" ".join(c[0]) for c in TRAIN_CASES])
def test_train_mtp_refuses_bad_arguments_before_loading(extra, expect, plain_target, tmp_path,
                                                         nothing_loads, capsys) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(CORPUS[0])
    (tmp_path / "file").write_text("")
    out = tmp_path / "out"
    if "--resume" in extra:  # a checkpoint of the default recipe (K = 3)
        from chainspec.training.mtp_recipe import MTPRecipe
        (out / "checkpoints").mkdir(parents=True)
        torch.save({"recipe": MTPRecipe().as_dict()}, out / "checkpoints" / "step-0000200.pt")
    subs = {"MISSING": str(tmp_path / "missing"), "UNDER_A_FILE": str(tmp_path / "file" / "o"),
            "TARGET": str(plain_target),
            "NO_GPU": "cuda" if not torch.cuda.is_available() else "cuda:999"}
    extra = [subs.get(a, a) for a in extra]
    threads = torch.get_num_threads()
    argv = ["train-mtp", "--target", str(plain_target), "--data", str(corpus), "--out",
            str(out), "--device", "cpu", *extra]  # NOTE: a later --device wins
    assert_one_line_refusal(*run_cli(argv, capsys), expect)
    assert torch.get_num_threads() == threads
    assert not out.exists() or "--resume" in extra  # nothing written


# ---------------------------------------------------------------- serve

@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def serve_config(tmp_path: Path, **stack) -> str:
    path = tmp_path / "serve.json"
    path.write_text(json.dumps(stack))
    return str(path)


SERVE_CASES = [  # (argv builder, what the line must name)
    (lambda busy, tmp: ["--port", str(busy)], "gateway.port"),
    (lambda busy, tmp: ["--port", "0", "--config",
                        serve_config(tmp, verifier={"port": busy})], "verifier.port"),
    (lambda busy, tmp: ["--port", "0", "--config",
                        serve_config(tmp, drafter={"metrics_port": busy})],
     "drafter.metrics_port"),
    (lambda busy, tmp: ["--port", "0", "--config",
                        serve_config(tmp, controller_metrics_port=busy)],
     "controller_metrics_port"),
    (lambda busy, tmp: ["--port", str(busy + 1), "--config",
                        serve_config(tmp, verifier={"metrics_port": busy + 1})],
     "are both port"),
    (lambda busy, tmp: ["--port", "0", "--verifiers", "2", "--config",
                        serve_config(tmp, verifier={"port": busy + 2})], "one per node"),
    (lambda busy, tmp: ["--port", "0", "--host", "203.0.113.7"], "gateway.port"),
]


@pytest.mark.parametrize("build,expect", SERVE_CASES, ids=[c[1] for c in SERVE_CASES])
def test_serve_checks_its_ports_before_starting_ray(build, expect, busy_port, tmp_path,
                                                    monkeypatch, capsys) -> None:
    import ray

    monkeypatch.setenv("CHAINSPEC_STATE_DIR", str(tmp_path))
    argv = build(busy_port, tmp_path)
    if "203.0.113.7" in argv:  # an address this machine does not have
        argv[1] = str(free_port())
    started = ray.is_initialized()
    assert_one_line_refusal(*run_cli(["serve", *argv], capsys), expect)
    assert ray.is_initialized() == started  # refused before Ray


# ---------------------------------------------------------------- --help

def _subparser(parser, *names: str):
    for name in names:
        (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
        parser = sub.choices[name]
    return parser


@pytest.mark.parametrize("names", [("bench", "serve"), ("train-mtp",), ("serve",)])
def test_every_help_shows_each_default(names) -> None:
    parser = _subparser(build_parser()[0], *names)
    formatter = parser._get_formatter()
    silent = [a.option_strings[0] for a in parser._actions if not shows_default(a, formatter)]
    assert not silent, f"chainspec {' '.join(names)} --help hides the defaults of {silent}"
    text = parser.format_help()
    assert "(default: %" not in text  # every default was filled in


def test_train_mtp_help_says_how_long_the_defaults_take() -> None:
    text = " ".join(_subparser(build_parser()[0], "train-mtp").format_help().split())
    assert "45 minutes" in text and "(default: 1400)" in text


def test_help_formatter_leaves_flags_and_said_defaults_alone() -> None:
    text = " ".join(_subparser(build_parser()[0], "bench", "serve").format_help().split())
    assert "requests per load point (default: 16)" in text
    assert "(default: False)" not in text and "(default: None)" not in text
    assert "(default: the first of /v1/models)" in text  # said once, not twice
    assert "/v1/models) (default" not in text
