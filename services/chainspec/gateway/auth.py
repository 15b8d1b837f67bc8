"""The optional API key: `Authorization: Bearer <key>` on every /v1 call."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from chainspec.gateway.errors import unauthorized


def check_api_key(headers: Mapping[str, str], api_key: str | None) -> None:
    """Raises APIError(401) unless `api_key` is unset or the header carries it."""
    if api_key is None:
        return
    value = headers.get("authorization")
    if value is None:
        raise unauthorized("missing API key: send 'Authorization: Bearer <key>'")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             api_key.encode()):
        raise unauthorized("invalid API key")
