"""OpenAI-style API errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

import re
from typing import Optional

from starlette.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unavailable(message: str, retry_after: int = 1) -> APIError:
    return APIError(503, message, "service_unavailable_error", None, "service_unavailable",
                    headers={"Retry-After": str(retry_after)})


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error", None, "internal_error")


def engine_failed(reason: str) -> APIError:
    """A 500 for the requests in flight when an engine rank died: which rank, not its raw error text
    (a collective's error on the other ranks, e.g. gloo's, means nothing to an API client; the log has it)."""
    match = re.match(r"engine (rank \d+)", reason)
    who = f"engine {match.group(1)} failed" if match else "the engine failed"
    return APIError(500, f"the request could not be completed: {who}; the server is shutting down",
                    "server_error", None, "engine_failed")
