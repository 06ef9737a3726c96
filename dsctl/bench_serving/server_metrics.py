"""Figures only a dsctl server reports, read from its Prometheus /metrics around a run (best effort:
another server, or no /metrics, gives None): speculative decoding's accepted length."""

from __future__ import annotations

from typing import Optional

import httpx

SPEC = "dsctl_spec_accepted_tokens"


def spec_counts(base: str, api_key: Optional[str] = None) -> Optional[tuple[float, float]]:
    """(sum, count) of the server's accepted-tokens histogram, or None when it has none."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        text = httpx.get(f"{base}/metrics", headers=headers, timeout=5).text
    except httpx.HTTPError:
        return None
    values = {}
    for line in text.splitlines():
        for suffix in ("_sum", "_count"):
            if line.startswith(SPEC + suffix + " "):
                values[suffix] = float(line.split()[1])
    return (values["_sum"], values["_count"]) if len(values) == 2 else None


def accept_length(before: Optional[tuple[float, float]], after: Optional[tuple[float, float]]) -> Optional[float]:
    """Mean tokens per request per speculative step during the run (None without speculation)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])
