"""A request body as JSON, within bounds, before any schema sees it.

- `Content-Type` must be JSON (`application/json` or `application/*+json`; absent is
  taken as JSON), else 415.
- The bytes are decoded with the declared `charset` (`charset=latin-1` bodies read as
  Latin-1, as their sender meant), UTF-8 when none is declared; a charset that is not a
  plain text encoding Python knows (`CHARSETS`) is 415 naming it. Then it must be JSON
  (RFC 8259): no `NaN`/`Infinity`, else 400.
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

import codecs
import json
import re
from typing import Any

from starlette.requests import Request

from chainspec.gateway.errors import field_name, invalid, unsupported_media_type

MAX_DEPTH = 64
MAX_INT_DIGITS = 20  # len(str(2 ** 64 - 1))
_LONG_DIGITS = re.compile(f"[0-9]{{{MAX_INT_DIGITS + 1}}}")
_SCALARS = {int, float, bool, type(None)}


# Python codec names (codecs.lookup(...).name) a body may be declared in; others (say
# "unicode_escape", "idna", "utf-7") are transforms or oddities no JSON client means.
CHARSETS = re.compile(r"utf-8|utf-(16|32)(-[lb]e)?|ascii|latin-1|iso8859-\d+|cp125\d")


async def read_json(request: Request) -> Any:
    """The body of a JSON request, or APIError (415, 400)."""
    charset = check_content_type(request.headers.get("content-type"))
    return decode(await request.body(), charset)


def check_content_type(value: str | None) -> str:
    """The charset a JSON `Content-Type` declares ("utf-8" if none), or APIError(415)."""
    if value is None:
        return "utf-8"
    media, *params = (part.strip() for part in value.split(";"))
    media = media.lower()
    if media != "application/json" and not (media.startswith("application/")
                                            and media.endswith("+json")):
        raise unsupported_media_type(value)
    charset = "utf-8"
    for param in params:
        key, _, val = param.partition("=")
        if key.strip().lower() == "charset":
            charset = _codec(val.strip().strip('"'), value)
    return charset


def _codec(charset: str, content_type: str) -> str:
    try:
        name = codecs.lookup(charset).name
    except LookupError:
        name = ""
    if not CHARSETS.fullmatch(name):
        raise unsupported_media_type(content_type, f"charset {charset!r} is not supported "
                                                   f"(UTF-8, UTF-16/32, Latin-1, ISO 8859 "
                                                   f"or Windows code pages are)")
    return name


def decode(raw: bytes, charset: str = "utf-8") -> Any:
    """`raw` (in `charset`) as JSON within the bounds above, or APIError(400)."""
    try:  # NOTE: a UTF-8 BOM is ignored (RFC 8259 allows it)
        text = raw.decode("utf-8-sig" if charset == "utf-8" else charset)
    except UnicodeDecodeError as e:
        raise invalid(None, f"the request body is not {charset.upper()}: {e}") from None
    wide = _wide_int if _LONG_DIGITS.search(text) else None  # the common case stays fast
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
