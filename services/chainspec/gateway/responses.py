"""OpenAI response bodies for both endpoints, and usage with speculative statistics.

`usage.speculative` (an extension) carries the request's counts from the verifier:
`rounds` (verify rounds, plain ones included), `draft_tokens`, `accepted_tokens`,
`acceptance_length` (tokens committed per round that carried drafts: 1 + accepted /
drafted rounds; 1.0 when nothing was drafted), `fallback_rounds` (rounds decoded plainly
for lack of drafts) and `accepted_per_position`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chainspec.gateway.errors import APIError
from chainspec.gateway.logprobs import (
    TokenBytes,
    TokenText,
    chat_logprobs,
    completion_logprobs,
)
from chainspec.rpc.generated.v1 import verifier_pb2 as pb

FINISH_REASONS = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop",
                  pb.FINISH_REASON_EOS: "stop", pb.FINISH_REASON_ABORT: "abort"}


def finish_reason(finished: pb.GenerateFinished) -> str:
    """The OpenAI finish reason; a request the verifier failed raises APIError(500)."""
    if finished.reason == pb.FINISH_REASON_ERROR or finished.reason not in FINISH_REASONS:
        raise APIError(500, f"the verifier failed the request: {finished.message}",
                       "server_error", None, "internal_error")
    return FINISH_REASONS[finished.reason]


def usage(stats: pb.RequestStats) -> dict[str, Any]:
    drafted_rounds = stats.rounds - stats.fallback_rounds
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        # vLLM's and OpenAI's: prompt tokens read from the prefix cache
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        "speculative": {
            "rounds": stats.rounds,
            "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens,
            "acceptance_length": round(1 + stats.accepted_tokens / drafted_rounds, 4)
            if drafted_rounds > 0 else 1.0,
            "fallback_rounds": stats.fallback_rounds,
            "accepted_per_position": list(stats.accepted_per_position),
        },
    }


@dataclass(frozen=True)
class Envelope:
    """What every body of one response shares."""

    id: str
    created: int
    model: str


class CompletionFormat:
    """`/v1/completions`: `text` choices."""

    object = "text_completion"
    chunk_object = "text_completion"
    prompt_field = "prompt"
    role_chunk = False

    @staticmethod
    def choice(text: str, finish: str | None, index: int = 0,
               logprobs: dict | None = None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def delta(text: str | None, finish: str | None, role: bool = False,
              index: int = 0, logprobs: dict | None = None) -> dict[str, Any]:
        return CompletionFormat.choice(text or "", finish, index, logprobs)

    @staticmethod
    def logprobs(lps, text: TokenText, offset: int, raw: TokenBytes | None = None
                 ) -> dict[str, Any]:
        return completion_logprobs(lps, text, offset)


class ChatFormat:
    """`/v1/chat/completions`: an assistant `message`; stream deltas open with the role."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prompt_field = "messages"
    role_chunk = True

    @staticmethod
    def choice(text: str, finish: str | None, index: int = 0,
               logprobs: dict | None = None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def delta(text: str | None, finish: str | None, role: bool = False,
              index: int = 0, logprobs: dict | None = None) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def logprobs(lps, text: TokenText, offset: int, raw: TokenBytes | None = None
                 ) -> dict[str, Any]:
        return chat_logprobs(lps, text, raw)


Format = CompletionFormat | ChatFormat


def full_body(fmt: type[Format], env: Envelope, choices: list[dict[str, Any]],
              stats: pb.RequestStats) -> dict[str, Any]:
    return {"id": env.id, "object": fmt.object, "created": env.created, "model": env.model,
            "choices": choices, "usage": usage(stats)}


def chunk_body(fmt: type[Format], env: Envelope, choices: list[dict[str, Any]],
               with_usage: bool, stats: pb.RequestStats | None = None) -> dict[str, Any]:
    body = {"id": env.id, "object": fmt.chunk_object, "created": env.created,
            "model": env.model, "choices": choices}
    if with_usage:  # OpenAI: usage null on every chunk but the last, which has no choices
        body["usage"] = usage(stats) if stats is not None else None
    return body
