"""JSON the gateway writes is strict RFC 8259: a non-finite float (NaN, Infinity) is never
written (Python's `json` would write the literal `NaN`, which strict clients cannot
parse). The engine floors -inf logprobs and never produces NaN (engine/logprobs.py), so a
non-finite number here is a server bug: it becomes a clean OpenAI-style 500 (or the
stream's error event), not a traceback or an unparseable body."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse

from chainspec.gateway.errors import APIError


def dumps(value: Any) -> str:
    """`value` as compact JSON text, or APIError(500) if it holds a non-finite float."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError as e:  # "Out of range float values are not JSON compliant"
        raise non_finite(str(e)) from None


def non_finite(detail: str) -> APIError:
    return APIError(500, f"the response held a non-finite number and was not sent as "
                         f"invalid JSON ({detail})", "server_error", None, "non_finite_number")


class StrictJSONResponse(JSONResponse):
    """A JSONResponse whose body is `dumps(content)`: building one raises APIError(500)
    for a non-finite float, which the app's handler answers as an error body."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")
