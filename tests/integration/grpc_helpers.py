"""Real gRPC on 127.0.0.1 for tests: a blocking handle on one Draft stream, tiny drafter
engines (servers run on `tests.integration.helpers.LoopThread`)."""

from __future__ import annotations

import queue
import socket
import time
from collections.abc import Callable

import grpc

from chainspec.engine.drafter import DrafterConfig, DrafterEngine
from chainspec.rpc.channel import DEFAULT_CLIENT_OPTIONS, ClientOptions, make_channel
from chainspec.rpc.draft_codec import stream_metadata
from chainspec.rpc.drafter_service import serve_drafter
from chainspec.rpc.generated.v1 import drafter_pb2 as pb
from chainspec.rpc.generated.v1 import drafter_pb2_grpc as pb_grpc
from chainspec.rpc.server import RunningServer, ServerOptions
from tests.integration.helpers import LoopThread


def drafter_engine(draft, k: int = 3, max_seqs: int = 8, max_len: int = 256,
                   top_k: int = 4) -> DrafterEngine:
    return DrafterEngine(draft, DrafterConfig(num_steps=k, max_seqs=max_seqs, max_len=max_len,
                                              top_k=top_k))


def start_drafter(loop: LoopThread, engine, name: str = "tiny", **server) -> RunningServer:
    return loop.run(serve_drafter(engine, ServerOptions(**server), name))


class DraftStream:
    """One Draft stream, driven in lockstep: `ask` sends a request, returns its answer."""

    def __init__(self, target: str, opts: ClientOptions = DEFAULT_CLIENT_OPTIONS,
                 max_seqs: int | None = None) -> None:
        self.channel = make_channel(target, opts)
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        metadata = stream_metadata(max_seqs) if max_seqs is not None else None
        self.responses = pb_grpc.DrafterStub(self.channel).Draft(iter(self.requests.get, None),
                                                                 metadata=metadata)

    def ask(self, request: pb.DraftRequest) -> pb.DraftResponse:
        self.requests.put(request)
        return next(self.responses)

    def close(self) -> None:
        self.requests.put(None)
        try:
            for _ in self.responses:
                pass
        except grpc.RpcError:
            pass
        self.channel.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return condition()
