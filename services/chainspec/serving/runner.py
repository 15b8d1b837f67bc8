"""Start and stop a whole serving stack: the Ray stack (`cluster.stack.up`) and the HTTP
gateway routed by the controller's membership. One code path for `chainspec serve` and
the demo.

The gateway runs on an event loop in a background thread, so the caller's main thread
stays free to wait for signals (Ctrl-C, or SIGTERM from `chainspec down`) or to drive the
demo's requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shlex
import threading
from pathlib import Path
from typing import Any

from chainspec.cluster import stack
from chainspec.gateway.chat_template import ChatTemplate
from chainspec.gateway.generation_config import sampling_defaults
from chainspec.gateway.membership import ControllerVerifiers
from chainspec.gateway.server import GatewayServer
from chainspec.serving.config import ServeConfig
from chainspec.serving.progress import Progress


class LoopThread:
    """An asyncio loop on a daemon thread; `run(coro)` from any other thread."""

    def __init__(self, name: str = "gateway-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()


class ServingStack:
    """A running stack and its gateway. `lost` is set if the stack is stopped from
    elsewhere (`chainspec down` against a shared Ray cluster)."""

    def __init__(self, config: ServeConfig, members: list[dict[str, Any]], embedded: bool,
                 loop: LoopThread) -> None:
        self.config, self.members, self.embedded, self.loop = config, members, embedded, loop
        self.gateway: GatewayServer | None = None
        self.target: stack.Target | None = None  # the stack it runs: Ray address, namespace
        self.lost = threading.Event()
        self._stopped = False

    @classmethod
    def start(cls, config: ServeConfig, progress: Progress | None = None) -> ServingStack:
        import ray

        progress = progress or Progress(quiet=True)
        embedded = config.address is None and not ray.is_initialized()
        progress.step("starting a local Ray" if embedded else
                      f"joining the Ray cluster at {config.address or 'this process'}")
        try:
            with progress.members(config.stack.namespace, "loading and warming up"):
                members = stack.up(config.stack, config.address, config.start_timeout_s)
        except BaseException:
            if embedded:
                ray.shutdown()
            raise
        progress.step("stack up: " + ", ".join(f"{m['member_id']} {m['state']}" for m in members))
        self = cls(config, members, embedded, LoopThread())
        try:
            self._start_gateway(progress)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_gateway(self, progress: Progress) -> None:
        c = self.config
        controller = stack.connect(c.address, c.stack.namespace)
        self.target = stack.target_of(c.stack.namespace)
        running = stack.config(c.address, c.stack.namespace)  # NOTE: with the stack's token
        model_dir = c.stack.model_dir if Path(c.stack.model_dir).is_dir() else None
        chat = ChatTemplate.from_model_dir(model_dir, c.gateway.chat_template)
        source = ControllerVerifiers(controller, on_lost=self.lost.set)
        gateway = dataclasses.replace(c.gateway, sampling_defaults=sampling_defaults(
            c.gateway.generation_config, model_dir))
        self.gateway = self.loop.run(GatewayServer.start(
            gateway, source, chat, running.client_options()))
        # NOTE: a local-mode verifier reports its in-process drafter as one connected
        want = 1 if c.stack.drafter.replicas > 0 or c.stack.drafter.local else 0
        progress.step(f"gateway listening on {self.url}; waiting for a verifier to serve"
                      + (" with its drafters connected" if want else ""))
        if not self.loop.run(self.gateway.wait_ready(c.start_timeout_s, drafters=want)):
            raise TimeoutError(f"no verifier became ready behind the gateway within "
                               f"{c.start_timeout_s:.0f} s")
        progress.step(f"ready: {self.describe()}")

    @property
    def url(self) -> str:
        return self.gateway.url if self.gateway is not None else ""

    def describe(self) -> str:
        views = [v for v in self.gateway.gateway.pool.views() if v.serving]
        drafters = self.gateway.drafters
        if self.config.stack.drafter.local:
            return (f"{len(views)} verifier(s), each drafting in process (drafter mode "
                    f"local, speculative decoding {'on' if drafters else 'off'})")
        mode = "speculative decoding on" if drafters else "no drafters: plain decoding"
        return f"{len(views)} verifier(s), {drafters} drafter(s) connected ({mode})"

    def model_name(self) -> str:
        return (self.gateway.gateway.model_names() or ["?"])[0]

    def curl_example(self, prompt: str = "def fibonacci(n):") -> str:
        """A curl line that calls this stack's completions endpoint."""
        body = json.dumps({"model": self.model_name(), "prompt": prompt, "max_tokens": 32,
                           "temperature": 0})
        auth = ' -H "Authorization: Bearer $CHAINSPEC_API_KEY"' \
            if self.config.gateway.api_key else ""
        return (f"curl {self.url}/v1/completions -H 'Content-Type: application/json'{auth} "
                f"-d {shlex.quote(body)}")

    def health(self) -> tuple[bool, int]:
        """(a verifier serves, drafters connected), as /health reports them."""
        g = self.gateway
        return (g.ready, g.drafters) if g is not None else (False, 0)

    def scale_drafters(self, n: int) -> None:
        """`chainspec scale drafters n`, then wait until the gateway sees the change."""
        c = self.config
        stack.scale("drafter", n, c.address, c.stack.namespace, wait=True)
        self.loop.run(self._until_drafters(n), timeout=c.start_timeout_s)

    async def _until_drafters(self, n: int) -> None:
        while self.gateway.drafters != n:
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        """Gateway first (no new requests), then the stack, then an embedded Ray."""
        import ray

        if self._stopped:
            return
        self._stopped = True
        if self.gateway is not None:
            self.loop.run(self.gateway.stop(), timeout=30)
            self.gateway = None
        self.loop.close()
        try:
            stack.down(self.config.address, self.config.stack.namespace)
        except stack.StackNotFound:
            pass  # stopped from elsewhere
        if self.embedded:
            ray.shutdown()
