"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}` with its status."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

#: the `type` OpenAI's API reports for each status this server answers with
ERROR_TYPES: dict[int, str] = {400: "invalid_request_error", 401: "invalid_request_error",
                               404: "invalid_request_error", 405: "invalid_request_error",
                               409: "invalid_request_error", 413: "invalid_request_error",
                               415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error"}


class APIError(Exception):
    """A request answered with an OpenAI-shaped error: its HTTP status, message, the field it
    is about (`param`) and a machine-readable `code`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        """The JSON body: OpenAI's error object."""
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The whole answer (401s also carry WWW-Authenticate, as HTTP asks)."""
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def not_found(kind: str, object_id: str, param: str = "id") -> APIError:
    """404 for an object this key cannot see (missing, deleted, or another key's)."""
    return APIError(404, f"No such {kind} object: {object_id}", param=param, code=None)
