"""The API key: `Authorization: Bearer <key>` on every route; /health without it says only ok / not ready."""

from __future__ import annotations

import hmac
from typing import Optional

from engine.server.errors import APIError

OPEN_PATHS = ("/health",)


def authorised(headers, key: Optional[str]) -> bool:
    """Whether raw ASGI headers [(name, value)] carry the key (always true when no key is set)."""
    if not key:
        return True
    auth = dict(headers or []).get(b"authorization", b"")
    scheme, _, token = auth.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())


class ApiKeyMiddleware:
    """Require the key on every HTTP route except OPEN_PATHS (pure ASGI, streaming-safe)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or authorised(scope.get("headers"), self.key):
            return await self.app(scope, receive, send)
        err = APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                       "invalid_request_error", None, "invalid_api_key")
        return await err.response()(scope, receive, send)
