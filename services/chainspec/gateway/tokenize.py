"""vLLM's tokenizer endpoints: `/tokenize` (a prompt, or a chat rendered as
`/v1/chat/completions` renders it) and `/detokenize`, in vLLM's request and response
shapes (`TokenizeCompletionRequest`/`TokenizeChatRequest` -> `{count, max_model_len,
tokens, token_strs}`; `DetokenizeRequest` -> `{prompt}`). Defaults follow vLLM:
`add_special_tokens` true for a prompt, false for a chat (its template holds the BOS).
The gateway's own tokenizer answers; no verifier is called."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chainspec.gateway.chat_template import ChatTemplate, Turn
from chainspec.gateway.errors import APIError, invalid
from chainspec.gateway.schemas import Bool, ChatMessage, TokenId, _first_error
from chainspec.models.tokenizer import Tokenizer


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: Bool = True
    return_token_strs: Bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    add_special_tokens: Bool = False
    return_token_strs: Bool = False
    chat_template: str | None = Field(None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId]


def parse_tokenize(body: Any) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """A chat request when the body has `messages`, else a prompt (vLLM's union)."""
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    model = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    return _validated(model, body)


def parse_detokenize(body: Any) -> DetokenizeRequest:
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    return _validated(DetokenizeRequest, body)


def _validated(model: type[BaseModel], body: dict) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _first_error(e) from None


def needs_tokenizer(chat: ChatTemplate) -> Tokenizer:
    if chat.tokenizer is None:
        raise APIError(501, "this gateway has no tokenizer (start it with the model "
                            "directory)", "invalid_request_error", None, "not_implemented")
    return chat.tokenizer


async def tokenize(chat: ChatTemplate, body: TokenizeCompletionRequest | TokenizeChatRequest,
                   max_model_len: int | None, trust_template: bool) -> dict[str, Any]:
    tokenizer = needs_tokenizer(chat)
    if isinstance(body, TokenizeChatRequest):
        if body.continue_final_message and body.messages[-1].role != "assistant":
            raise invalid("continue_final_message", "the last message must be the "
                                                    "assistant's")
        text = await chat.render([Turn(m.role, m.text()) for m in body.messages],
                                 body.add_generation_prompt and not body.continue_final_message,
                                 body.continue_final_message, body.chat_template_kwargs,
                                 body.chat_template, trust_template=trust_template)
    else:
        text = body.prompt
    ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens) if text else []
    strs = [tokenizer.backend.id_to_token(i) for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": strs}


def detokenize(chat: ChatTemplate, body: DetokenizeRequest) -> dict[str, Any]:
    tokenizer = needs_tokenizer(chat)
    if any(t >= tokenizer.vocab_size for t in body.tokens):
        bad = next(i for i, t in enumerate(body.tokens) if t >= tokenizer.vocab_size)
        raise invalid(f"tokens[{bad}]", f"{body.tokens[bad]} is not a token id (the "
                                        f"vocabulary has {tokenizer.vocab_size})")
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}
