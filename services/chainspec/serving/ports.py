"""The fixed ports `chainspec serve` will listen on, checked before anything starts: the
gateway's HTTP port, and on an embedded (local) Ray the stack's fixed gRPC and metrics
ports too. A busy port is then one line and exit 2 in a second, not an error after Ray,
the controller and every member have come up. Port 0 (any free port) is never checked.

NOTE: a probe, not a reservation: a port taken between this check and the bind is still
reported by the bind itself (`gateway.server.bind`, the members' servers).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from chainspec.serving.config import ServeConfig


@dataclass(frozen=True)
class Listener:
    what: str  # the config key that fixes it: "gateway.port", "verifier.metrics_port"
    host: str
    port: int


def fixed_listeners(config: ServeConfig, embedded: bool) -> list[Listener]:
    """Every fixed port this command's machine will bind: the gateway's always; the
    stack's only on an embedded Ray (on a cluster its members may run on other nodes)."""
    g = config.gateway
    out = [Listener("gateway.port", g.host, g.port)] if g.port else []
    if not embedded:
        return out
    s = config.stack
    for role, members in (("verifier", s.verifier.replicas), ("drafter", _drafters(config))):
        r = s.role(role)
        for key, port in (("port", r.port), ("metrics_port", r.metrics_port)):
            if not port or not members:
                continue
            if members > 1:  # NOTE: one Ray node here, so every member would share it
                raise ValueError(f"{role}.{key} {port} is fixed, but {members} {role}s would "
                                 f"run on this machine (a fixed port allows one per node); "
                                 f"use 0 for any free port")
            out.append(Listener(f"{role}.{key}", s.host, port))
    if s.controller_metrics_port:
        out.append(Listener("controller_metrics_port", s.host, s.controller_metrics_port))
    return out


def _drafters(config: ServeConfig) -> int:
    d = config.stack.drafter
    if d.local:
        return 0
    return max(d.replicas, d.autoscale.max_drafters if d.autoscale is not None else 0)


def check_ports(config: ServeConfig, embedded: bool) -> None:
    """ValueError (one line, naming the config key) for a fixed port that two listeners
    share or that cannot be bound now."""
    listeners = fixed_listeners(config, embedded)
    seen: dict[int, Listener] = {}
    for listener in listeners:
        other = seen.setdefault(listener.port, listener)
        if other is not listener:
            raise ValueError(f"{other.what} and {listener.what} are both port {listener.port}")
    for listener in listeners:
        probe(listener)


def probe(listener: Listener) -> None:
    """Bind host:port as the gateway does (SO_REUSEADDR: a socket in TIME_WAIT is not
    busy), then let go."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            listener.host.strip("[]"), listener.port, type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
    except OSError as e:
        raise ValueError(f"{listener.what}: cannot listen on {listener.host}:{listener.port}: "
                         f"{e.strerror or e} (nothing was started)") from None
