"""OpenAI `logprobs` objects from the verifier's per-token logprobs (TokenChunk.logprobs:
the target's distribution after penalties and bias, before temperature and truncation).

Token strings come from the model's tokenizer when the gateway has the model directory;
without one each token is shown as `token_id:<id>` (vLLM's return_tokens_as_token_ids
form)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from chainspec.rpc.generated.v1 import verifier_pb2 as pb

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


def token_id_text(token: int) -> str:
    return f"token_id:{token}"


def completion_logprobs(lps: Sequence[pb.TokenLogprob], text: TokenText,
                        offset: int) -> dict[str, Any]:
    """`/v1/completions`: parallel lists; `text_offset` from `offset` in the choice text."""
    tokens = [text(lp.token_id) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{text(t.token_id): t.logprob for t in lp.top_logprobs}
                             for lp in lps],
            "text_offset": offsets}


def chat_logprobs(lps: Sequence[pb.TokenLogprob], text: TokenText,
                  raw: TokenBytes | None = None) -> dict[str, Any]:
    """`/v1/chat/completions`: one entry per token with its top alternatives. `bytes`:
    the token's own bytes (`raw`, gateway/token_bytes.py), else the UTF-8 of its text."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        s = text(token)
        return {"token": s, "logprob": logprob,
                "bytes": list(raw(token) if raw is not None else s.encode("utf-8"))}
    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t.token_id, t.logprob)
                                          for t in lp.top_logprobs]} for lp in lps]}
