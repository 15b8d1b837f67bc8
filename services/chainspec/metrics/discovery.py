"""Prometheus HTTP service discovery (`http_sd_configs`) from the stack's membership."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit


def http_sd_groups(members: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One target group per live member with a metrics endpoint:
    `{"targets": ["host:port"], "labels": {"role", "member", "__metrics_path__"}}`."""
    groups = []
    for m in sorted(members, key=lambda m: m["member_id"]):
        url = m.get("metrics_url")
        if not url or m.get("state") == "dead":
            continue
        parts = urlsplit(url)
        groups.append({"targets": [parts.netloc],
                       "labels": {"role": m["role"], "member": m["member_id"],
                                  "__metrics_path__": parts.path or "/metrics"}})
    return groups
