"""Errors of the HTTP API: one exception type with an OpenAI-style body, and the mapping
from the verifier's gRPC status codes.

Body: `{"error": {"message", "type", "param", "code"}}`. A message about one field starts
with the field's name as the client spelled it (`max_tokens: ...`, `messages[1].role: ...`)
and `param` carries the same name. Text that cannot be UTF-8 (lone surrogates the client
sent) is shown backslash-escaped, so every error body can be encoded.
"""

from __future__ import annotations

import re

import grpc


class APIError(Exception):
    """An HTTP error answer; raise it anywhere below a route."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        message, param = printable(message), printable(param)
        super().__init__(message)
        self.status, self.message, self.type = status, message, type_
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def field_name(path) -> str | None:
    """A field's HTTP name from its path: ("messages", 0, "content") -> messages[0].content."""
    name = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
    return name.removeprefix(".") or None


def invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    text = f"{param}: {message}" if param else message
    return APIError(400, text, "invalid_request_error", param, code)


def unsupported(param: str, what: str) -> APIError:
    return invalid(param, f"{what} is not supported by this server", "unsupported_parameter")


def unauthorized(message: str) -> APIError:
    return APIError(401, message, "authentication_error", None, "invalid_api_key",
                    {"WWW-Authenticate": "Bearer"})


def overloaded(message: str, retry_after_s: int) -> APIError:
    return APIError(429, message, "rate_limit_error", None, "overloaded",
                    {"Retry-After": str(retry_after_s)})


def unavailable(message: str, retry_after_s: int = 1) -> APIError:
    return APIError(503, message, "service_unavailable", None, "unavailable",
                    {"Retry-After": str(retry_after_s)})


def too_large(message: str) -> APIError:
    return APIError(413, message, "invalid_request_error", None, "request_too_large")


def unsupported_media_type(content_type: str, why: str | None = None) -> APIError:
    message = f"Content-Type {content_type!r}: {why}" if why else \
        f"the request body must be JSON (Content-Type: application/json), got {content_type!r}"
    return APIError(415, message, "invalid_request_error", None, "unsupported_media_type")


def printable(text: str | None) -> str | None:
    """`text` with lone surrogates escaped (`\\ud800`), so it encodes as UTF-8."""
    if text is None or text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def not_found(path: str) -> APIError:
    return APIError(404, f"no route {path}", "invalid_request_error", None, "not_found")


# The verifier names fields by their path in GenerateRequest; the client knows them by the
# HTTP name. `prompt.*` becomes the endpoint's prompt field ("prompt" or "messages").
_WIRE_FIELDS = {"sampling.temperature": "temperature", "sampling.top_p": "top_p",
                "sampling.top_k": "top_k", "sampling.seed": "seed", "stop.stop": "stop",
                "stop.max_tokens": "max_tokens", "stop.stop_token_ids": "stop_token_ids",
                "sampling.presence_penalty": "presence_penalty",
                "sampling.frequency_penalty": "frequency_penalty",
                "sampling.repetition_penalty": "repetition_penalty",
                "sampling.logit_bias": "logit_bias", "sampling.min_p": "min_p",
                "sampling.min_tokens": "min_tokens", "sampling.logprobs": "logprobs",
                "priority": "priority"}
_WIRE_PATH = re.compile(r"^([a-z_]+(?:\.[a-z_]+)*)(\[\d+\])?(: | )")


def http_param(wire_message: str, prompt_field: str) -> tuple[str | None, str]:
    """(HTTP field, message) of a verifier INVALID_ARGUMENT. `path: text` becomes `text`;
    other messages (`prompt.tokens.ids[1] = 900 is out of range ...`) stay whole."""
    match = _WIRE_PATH.match(wire_message)
    if match is None:
        return None, wire_message
    path = match.group(1)
    rest = wire_message[match.end():] if match.group(3) == ": " else wire_message
    if path == "prompt" or path.startswith("prompt."):
        return prompt_field, rest
    param = _WIRE_FIELDS.get(path)
    return param, rest if param else wire_message


def from_grpc(error: grpc.aio.AioRpcError, prompt_field: str, retry_after_s: int) -> APIError:
    """The HTTP answer for a status the verifier ended a Generate call with."""
    code, details = error.code(), error.details() or code_name(error.code())
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        param, message = http_param(details, prompt_field)
        kind = "context_length_exceeded" if "fit the context" in message else "invalid_value"
        return invalid(param, message, kind)
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return APIError(401, f"the verifier refused the gateway: {details}",
                        "authentication_error", None, "unauthenticated")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and "message larger than max" in details:
        # NOTE: gRPC's own message-size limit, not a full server: no retry can succeed
        return too_large(f"the request is too large for the verifier: {details}")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return overloaded(f"the server is at capacity: {details}", retry_after_s)
    if code is grpc.StatusCode.UNAVAILABLE:
        return unavailable(f"no verifier could take the request: {details}", retry_after_s)
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, f"the request timed out: {details}", "timeout", None, "timeout")
    return APIError(500, f"the verifier failed the request ({code_name(code)}): {details}",
                    "server_error", None, "internal_error")


def code_name(code: grpc.StatusCode) -> str:
    return code.name if code is not None else "UNKNOWN"
