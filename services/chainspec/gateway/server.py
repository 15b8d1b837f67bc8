"""Hosting the gateway: uvicorn on a socket we bind ourselves (so a busy port is an
OSError here, and port 0 gives a known ephemeral port), the verifier pool's refresh
loop, and the membership source, all on the caller's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import uvicorn

from chainspec.gateway.app import Gateway
from chainspec.gateway.asgi import build_app
from chainspec.gateway.chat_template import ChatTemplate
from chainspec.gateway.config import GatewayConfig
from chainspec.gateway.routing import VerifierPool
from chainspec.rpc.channel import DEFAULT_CLIENT_OPTIONS, ClientOptions

GRACEFUL_SHUTDOWN_S = 5.0


class _Uvicorn(uvicorn.Server):
    def capture_signals(self):  # NOTE: the host process owns its signals
        return contextlib.nullcontext()


class GatewayServer:
    """A running gateway. `start` returns once it listens; `ready` tells whether a
    verifier serves."""

    def __init__(self, gateway: Gateway, server: _Uvicorn, sock: socket.socket,
                 tasks: list[asyncio.Task]) -> None:
        self.gateway, self._server, self._sock, self._tasks = gateway, server, sock, tasks
        self.port: int = sock.getsockname()[1]

    @classmethod
    async def start(cls, config: GatewayConfig, source, chat: ChatTemplate | None = None,
                    client: ClientOptions = DEFAULT_CLIENT_OPTIONS) -> GatewayServer:
        pool = VerifierPool(client, config.refresh_interval_s)
        gateway = Gateway(config, pool, chat or ChatTemplate(), source.members)
        sock = bind(config.host, config.port)
        server = _Uvicorn(uvicorn.Config(build_app(gateway), log_config=None,
                                         log_level="warning", access_log=False, lifespan="off",
                                         timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(pool.run()), loop.create_task(server.serve(sockets=[sock]))]
        self = cls(gateway, server, sock, tasks)
        tasks.append(loop.create_task(source.run(pool, self.member_info)))
        while not server.started:
            if tasks[1].done():  # failed to start
                await self.stop()
                tasks[1].result()
                raise OSError(f"the gateway could not start on {config.host}:{config.port}")
            await asyncio.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        host = self.gateway.config.host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def ready(self) -> bool:
        return self.gateway.pool.ready

    @property
    def drafters(self) -> int:
        """The most drafters a serving verifier is connected to."""
        return max((v.drafters for v in self.gateway.pool.views() if v.serving), default=0)

    def member_info(self) -> dict:
        """This gateway as a member of the stack (see membership.ControllerVerifiers)."""
        host = self.gateway.config.host
        return {"serving": self.ready, "endpoint": f"{host}:{self.port}",
                "load": self.gateway.in_flight, "pid": os.getpid(), "error": None,
                "metrics_url": f"{self.url}/metrics"}

    async def wait_ready(self, timeout_s: float, drafters: int = 0) -> bool:
        """Wait until a verifier serves (and is connected to `drafters` drafters)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not (self.ready and self.drafters >= drafters):
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def stop(self) -> None:
        self._server.should_exit = True
        source = self._tasks[2]  # first: it leaves the membership
        source.cancel()
        await asyncio.gather(source, return_exceptions=True)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._tasks[1]), GRACEFUL_SHUTDOWN_S + 5)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._sock.close()
        self.gateway.chat.close()  # its render workers


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port (OSError names the address)."""
    sock = None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise OSError(f"the gateway cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock
