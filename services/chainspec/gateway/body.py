"""A request body as JSON, within bounds, before any schema sees it.

- `Content-Type` must be JSON (`application/json` or `application/*+json`; absent is
  taken as JSON), else 415.
- The bytes must be UTF-8 JSON (RFC 8259): no `NaN`/`Infinity`, else 400.
- Nesting is at most `MAX_DEPTH` levels (deeper: 400, never a RecursionError).
- An integer of more than `MAX_INT_DIGITS` digits is beyond every field's range (the
  widest on the wire is uint64); it decodes as a float, as JavaScript reads it, so the
  schema refuses it by name and `int()` never parses thousands of digits.
- Every string, keys included, must be Unicode text the wire (UTF-8) can carry: a lone
  surrogate (`"\\ud800"`) is 400 naming the field (`prompt`, `stop[1]`,
  `messages[0].content`).
The size limit comes before all this, in `body_limit.BodyLimit`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request

from chainspec.gateway.errors import field_name, invalid, unsupported_media_type

MAX_DEPTH = 64
MAX_INT_DIGITS = 20  # len(str(2 ** 64 - 1))
_LONG_DIGITS = re.compile(rb"\d{%d}" % (MAX_INT_DIGITS + 1))
_SCALARS = {int, float, bool, type(None)}


async def read_json(request: Request) -> Any:
    """The body of a JSON request, or APIError (415, 400)."""
    check_content_type(request.headers.get("content-type"))
    return decode(await request.body())


def check_content_type(value: str | None) -> None:
    if value is None:
        return
    media = value.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/")
                                            and media.endswith("+json")):
        raise unsupported_media_type(value)


def decode(raw: bytes) -> Any:
    """`raw` as JSON within the bounds above, or APIError(400)."""
    try:
        text = raw.decode("utf-8-sig")  # a BOM is ignored (RFC 8259 allows it)
    except UnicodeDecodeError as e:
        raise invalid(None, f"the request body is not UTF-8: {e}") from None
    wide = _wide_int if _LONG_DIGITS.search(raw) else None  # the common case stays fast
    try:
        value = json.loads(text, parse_int=wide, parse_constant=_constant)
    except RecursionError:
        raise _too_deep(None) from None
    except ValueError as e:  # incl. JSONDecodeError
        raise invalid(None, f"the request body is not valid JSON: {e}") from None
    _check_tree(value)
    return value


def _wide_int(digits: str) -> int | float:
    return int(digits) if len(digits.lstrip("-")) <= MAX_INT_DIGITS else float(digits)


def _constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _check_tree(body: Any) -> None:
    """Nesting depth and text of every value (iteratively: no recursion to exhaust)."""
    todo: list[tuple[Any, tuple[str | int, ...]]] = [(body, ())]
    while todo:
        value, path = todo.pop()
        if isinstance(value, str):
            _check_text(value, path)
            continue
        if not isinstance(value, dict | list):
            continue
        if len(path) >= MAX_DEPTH:
            raise _too_deep(field_name(path[:1]))
        if isinstance(value, list) and set(map(type, value)) <= _SCALARS:
            continue  # e.g. token ids: nothing inside to check
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            if isinstance(key, str):
                _check_text(key, (*path, key))
            if isinstance(child, str | list | dict):
                todo.append((child, (*path, key)))


def _check_text(text: str, path: tuple[str | int, ...]) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid(field_name(path), f"not valid Unicode text: a lone surrogate "
                                        f"{text[e.start]!r} at index {e.start}") from None


def _too_deep(param: str | None):
    return invalid(param, f"JSON nested more than {MAX_DEPTH} levels deep")
