"""The chainspec invocations of a rendered container, run for real with --dry-run.

A container either runs `chainspec ...` or `/bin/sh -c SCRIPT` whose every command is a
chainspec invocation (joined by ;, &&, ||, braces, newlines, `exec`). Paths under the
container's volume mounts are mapped into a sandbox holding what the pod would see:
ConfigMap files from the rendered ConfigMap (so a wrong key fails), placeholder files for
external Secrets, empty directories otherwise.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from chainspec import cli

SHELLS = ("/bin/sh", "sh", "/bin/bash", "bash")
OPERATORS = {";", "&&", "||", "{", "}"}


@dataclass(frozen=True)
class Invocation:
    argv: tuple[str, ...]  # after `chainspec`
    exec: bool = False  # replaces the shell (gets the container's signals)

    @property
    def command(self) -> str:
        return self.argv[0]


def invocations(container: dict) -> list[Invocation]:
    cmd = [*container.get("command", []), *container.get("args", [])]
    assert cmd, f"container {container['name']}: no command"
    if cmd[0] in SHELLS:
        assert cmd[1:2] == ["-c"] and len(cmd) == 3, f"{container['name']}: {cmd}"
        return parse_script(cmd[2])
    assert cmd[0] == "chainspec", f"container {container['name']} runs {cmd[0]!r}"
    return [Invocation(tuple(cmd[1:]))]


def parse_script(script: str) -> list[Invocation]:
    """Every command of a shell script; anything but chainspec is an error."""
    check = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True)
    assert check.returncode == 0, f"shell syntax: {check.stderr}"
    lexer = shlex.shlex(script.replace("\n", " ; "), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    out, words = [], []
    for token in [*lexer, ";"]:
        if token not in OPERATORS:
            words.append(token)
            continue
        if words:
            is_exec = words[0] == "exec"
            argv = words[1:] if is_exec else words
            assert argv[0] == "chainspec", f"the script runs {argv[0]!r}: {script}"
            out.append(Invocation(tuple(argv[1:]), is_exec))
        words = []
    return out


def sandbox(pod_spec: dict, container: dict, configmaps: dict[str, dict], root: Path,
            argv: tuple[str, ...]) -> tuple[str, ...]:
    """`argv` with mounted paths moved under `root`, filled as the pod would see them."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    mounts = sorted(container.get("volumeMounts", []), key=lambda m: -len(m["mountPath"]))
    for m in mounts:
        _fill(volumes[m["name"]], configmaps, root / m["name"])
    out = []
    for arg in argv:
        for m in mounts:
            mp = m["mountPath"].rstrip("/")
            if arg == mp or arg.startswith(mp + "/"):
                local = root / m["name"] / arg[len(mp):].lstrip("/")
                if "secret" in volumes[m["name"]] and not local.exists():
                    local.parent.mkdir(parents=True, exist_ok=True)
                    local.write_text(f"placeholder-{local.name}\n")  # external Secret
                arg = str(local)
                break
        out.append(arg)
    return tuple(out)


def _fill(volume: dict, configmaps: dict[str, dict], where: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    if "configMap" in volume:
        name = volume["configMap"]["name"]
        assert name in configmaps, f"volume {volume['name']}: no ConfigMap {name} rendered"
        for key, text in configmaps[name].get("data", {}).items():
            (where / key).write_text(text)


def dry_run(argv: tuple[str, ...]) -> dict:
    """Run `chainspec ARGV --dry-run` in this process; its resolved config as JSON."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main([*argv, "--dry-run"])
    except SystemExit as e:  # argparse refused the arguments
        raise AssertionError(f"chainspec {shlex.join(argv)}: {err.getvalue()}") from e
    assert rc == 0, f"chainspec {shlex.join(argv)} --dry-run: rc {rc}: {err.getvalue()}"
    return json.loads(out.getvalue())
