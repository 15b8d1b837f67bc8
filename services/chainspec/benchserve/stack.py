"""What a chainspec stack adds to a plain OpenAI endpoint: its drafter count (the
gateway's `/health`), its verifiers' spec-decode counters (found through the gateway's
`/v1/metrics/targets`), and scaling drafters (the `chainspec scale` command, which finds
the stack from --address or the namespace's state file, as every stack command does)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from chainspec.cluster.autoscale import AutoscalePolicy

SPEC = "chainspec_spec_decode_"
SCALE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class SpecCounters:
    """Sums over every verifier of the stack (counters only grow: deltas are a window)."""

    drafts: float = 0.0  # verify rounds that carried drafts
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: tuple[float, ...] = ()

    def minus(self, before: SpecCounters) -> SpecCounters:
        n = max(len(self.per_position), len(before.per_position))
        pad = lambda xs: tuple(xs) + (0.0,) * (n - len(xs))  # noqa: E731
        return SpecCounters(self.drafts - before.drafts,
                            self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted,
                            tuple(a - b for a, b in zip(pad(self.per_position),
                                                        pad(before.per_position), strict=True)))

    def figures(self) -> dict:
        """Acceptance length (tokens per drafted round: 1 + accepted / rounds) and the
        share of drafted rounds that accepted each position; None without drafts."""
        if self.drafts <= 0:
            return {"drafted_rounds": 0, "acceptance_length": None, "per_position": []}
        return {"drafted_rounds": int(self.drafts), "draft_tokens": int(self.draft_tokens),
                "accepted_tokens": int(self.accepted),
                "acceptance_length": 1 + self.accepted / self.drafts,
                "per_position": [a / self.drafts for a in self.per_position]}


def parse_counters(texts: list[str]) -> SpecCounters:
    """Sum the spec-decode counters of several Prometheus expositions."""
    sums = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    per_pos: dict[int, float] = {}
    names = {f"{SPEC}num_drafts": "drafts", f"{SPEC}num_draft_tokens": "draft_tokens",
             f"{SPEC}num_accepted_tokens": "accepted"}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not s.name.endswith("_total"):
                    continue
                base = s.name[:-len("_total")]
                if base in names:
                    sums[names[base]] += s.value
                elif base == f"{SPEC}num_accepted_tokens_per_pos":
                    pos = int(s.labels["position"])
                    per_pos[pos] = per_pos.get(pos, 0.0) + s.value
    positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos, default=-1) + 1))
    return SpecCounters(sums["drafts"], sums["draft_tokens"], sums["accepted"], positions)


async def drafters(client: httpx.AsyncClient) -> int | None:
    """The drafters serving verifiers are connected to; None: not a chainspec gateway."""
    try:
        r = await client.get("/health")
        body = r.json()
    except (httpx.HTTPError, ValueError):
        return None
    return body.get("drafters") if isinstance(body, dict) and "drafters" in body else None


async def spec_counters(client: httpx.AsyncClient) -> SpecCounters:
    groups = (await client.get("/v1/metrics/targets")).raise_for_status().json()
    urls = [f"http://{t}{g['labels'].get('__metrics_path__', '/metrics')}"
            for g in groups if g["labels"].get("role") == "verifier" for t in g["targets"]]
    texts = [(await client.get(u)).raise_for_status().text for u in urls]
    return parse_counters(texts)


class DrafterSampler:
    """Samples the drafter count every `period_s` into `samples` [(t_s, n)] until
    stopped; t runs from `t0` (perf_counter)."""

    def __init__(self, client: httpx.AsyncClient, t0: float, period_s: float = 0.5) -> None:
        self.client, self.t0, self.period_s = client, t0, period_s
        self.samples: list[tuple[float, int]] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            n = await drafters(self.client)
            if n is not None:
                self.samples.append((round(time.perf_counter() - self.t0, 2), n))
            await asyncio.sleep(self.period_s)


async def _chainspec(*argv: str) -> str:
    """Run `chainspec argv...`; its stdout (Ray's logs on stderr stay out of `--json`), or
    RuntimeError with the last line it wrote (`chainspec X: ...` says why)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "chainspec.cli", *argv,
                                                stdout=subprocess.PIPE,
                                                stderr=subprocess.PIPE)
    out, err = await proc.communicate()
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        lines = (err.decode(errors="replace") + "\n" + text).splitlines()
        why = next((line for line in reversed(lines) if line.strip()), "")
        raise RuntimeError(f"`chainspec {' '.join(argv)}` failed ({proc.returncode}): "
                           f"{why.strip()[-500:]}")
    return text


async def autoscale_spec(stack_args: list[str]) -> str | None:
    """`auto:MIN-MAX` of a stack whose drafters autoscale (`chainspec status --json`),
    else None."""
    text = await _chainspec("status", "--json", *stack_args)
    try:
        policy = (json.loads(text).get("autoscale") or {}).get("policy")
    except (ValueError, AttributeError):
        raise RuntimeError(f"`chainspec status --json` printed no JSON: {text[-200:]!r}") \
            from None
    return AutoscalePolicy(**policy).spec if policy else None


async def scale_drafters(client: httpx.AsyncClient, n: int | str,
                         stack_args: list[str]) -> None:
    """`chainspec scale drafters n <stack_args>`, then until the gateway sees n drafters
    (an `auto:MIN-MAX` n: at least MIN)."""
    await _chainspec("scale", "drafters", str(n), *stack_args)
    if isinstance(n, str):
        low = AutoscalePolicy.parse(n).min_drafters
        done = lambda got: got is not None and got >= low  # noqa: E731
    else:
        done = lambda got: got == n  # noqa: E731
    deadline = time.monotonic() + SCALE_TIMEOUT_S
    while not done(await drafters(client)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway did not see {n} drafter(s) within "
                               f"{SCALE_TIMEOUT_S:.0f} s")
        await asyncio.sleep(0.5)
