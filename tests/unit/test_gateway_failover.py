"""The gateway's failover rules without a server: which statuses resume and how often,
what a continuation request carries, and when a verifier that failed a stream may take
it again."""

from __future__ import annotations

import grpc
import pytest

from chainspec.gateway.client import GenerationSpec, Processing
from chainspec.gateway.failover import MAX_RESUMES, Avoid, Failover, Progress
from chainspec.rpc.generated.v1 import verifier_pb2 as pb


class _Status(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "test")


@pytest.mark.parametrize("code, resumes", [
    (grpc.StatusCode.UNAVAILABLE, True), (grpc.StatusCode.INTERNAL, True),
    (grpc.StatusCode.UNKNOWN, True), (grpc.StatusCode.INVALID_ARGUMENT, False),
    (grpc.StatusCode.DEADLINE_EXCEEDED, False), (grpc.StatusCode.RESOURCE_EXHAUSTED, False),
    (grpc.StatusCode.CANCELLED, False), (grpc.StatusCode.UNAUTHENTICATED, False)])
def test_only_a_failing_verifier_resumes_and_only_so_often(code, resumes) -> None:
    failover = Failover()
    assert failover.allows(_Status(code), 0) is resumes
    assert failover.allows(_Status(code), MAX_RESUMES - 1) is resumes
    assert not failover.allows(_Status(code), MAX_RESUMES)


def test_a_continuation_is_the_same_request_plus_what_the_client_has() -> None:
    spec = GenerationSpec("cmpl-1", "hello", 40, 0.7, 0.9, 5, 2 ** 64 - 1, ("END",), True,
                          (7,), True, Processing(presence_penalty=0.5, min_tokens=3,
                                                 logprobs=2), parent_request_id="p")
    progress = Progress()
    for ids, text in (([4, 5], "ab"), ([6], ""), ([8, 9], "€d")):
        progress.add(pb.GenerateResponse(chunk=pb.TokenChunk(token_ids=ids, text=text)))
    progress.add(pb.GenerateResponse(finished=pb.GenerateFinished()))  # no tokens
    first, again = spec.message(), spec.resumed(1, progress).message()
    assert not first.HasField("continuation")
    assert list(again.continuation.token_ids) == [4, 5, 6, 8, 9]
    assert again.continuation.text_sent == 4  # characters, not bytes
    assert again.request_id == "cmpl-1-r1"
    again.ClearField("continuation")
    again.request_id = first.request_id
    assert again == first  # prompt, sampling, seed, stops, logprobs, max_tokens alike


def test_a_failed_verifier_is_avoided_until_it_serves_again() -> None:
    avoid = Avoid()
    assert avoid.allows("a:1", 0)
    avoid.add("a:1", 3)
    assert not avoid.allows("a:1", 3) and avoid.allows("b:1", 0)
    assert avoid.allows("a:1", 4)  # seen out of service and SERVING again
