"""One streamed `/v1/completions` request, timed the way `vllm bench serve` times it:
TTFT is send to the first text chunk, ITL the gaps between text chunks (a chunk may carry
several tokens: a speculative round's), e2e send to the end of the stream, and TPOT
(e2e - TTFT) / (output tokens - 1), with the token count from the stream's usage."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from chainspec.benchserve.dataset import BenchRequest


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None  # a short kind: "http 500", "ReadTimeout", "stream error"
    start_s: float = 0.0  # perf_counter at send
    end_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def request_body(req: BenchRequest, model: str) -> dict:
    prompt = list(req.prompt) if isinstance(req.prompt, tuple) else req.prompt
    return {"model": model, "prompt": prompt, "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def send(client: httpx.AsyncClient, req: BenchRequest, model: str) -> RequestResult:
    """Never raises for a failed request: the result carries the error."""
    result = RequestResult(start_s=time.perf_counter())
    try:
        async with client.stream("POST", "/v1/completions",
                                 json=request_body(req, model)) as response:
            if response.status_code != 200:
                await response.aread()
                result.error = f"http {response.status_code}"
            else:
                await _read_events(response, result)
    except httpx.HTTPError as e:
        result.error = type(e).__name__
    result.end_s = time.perf_counter()
    result.ok = result.error is None
    return result


async def _read_events(response: httpx.Response, result: RequestResult) -> None:
    last, chunks, done = None, 0, False
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        now, event = time.perf_counter(), json.loads(data)
        if "error" in event:
            result.error = "stream error"
            return
        if any(c.get("text") for c in event.get("choices") or ()):
            if last is None:
                result.ttft_s = now - result.start_s
            else:
                result.itl_s.append(now - last)
            last, chunks = now, chunks + 1
        if event.get("usage"):
            result.output_tokens = event["usage"].get("completion_tokens", 0)
            result.prompt_tokens = event["usage"].get("prompt_tokens")
    if not done:
        result.error = "stream cut"
    elif result.output_tokens == 0:  # a server that sends no usage: count chunks
        result.output_tokens = chunks
