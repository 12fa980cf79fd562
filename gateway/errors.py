"""The gateway's one error type and how it shows on each surface (gRPC status, OpenAI-style HTTP).

Everything below the servicers raises `GatewayError(code, message, param)`: `code` is a gRPC status
name, `param` the request field at fault (named in the message too). The gRPC servicer aborts with
that status; the HTTP layer answers `{"error": {"message", "type", "param", "code"}}` with the status
of `HTTP_STATUS`.
"""

from __future__ import annotations

HTTP_STATUS = {
    "INVALID_ARGUMENT": 400, "OUT_OF_RANGE": 400, "FAILED_PRECONDITION": 409, "ALREADY_EXISTS": 409,
    "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504, "CANCELLED": 499, "UNIMPLEMENTED": 501,
}
HTTP_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 409: "invalid_request_error", 429: "rate_limit_error"}


class GatewayError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    @property
    def http_status(self) -> int:
        return HTTP_STATUS.get(self.code, 500)

    def openai_body(self) -> dict:
        status = self.http_status
        return {"error": {"message": self.message, "type": HTTP_TYPE.get(status, "server_error"),
                          "param": self.param, "code": self.code.lower()}}


def invalid(param: str, message: str) -> GatewayError:
    """INVALID_ARGUMENT naming the field: the message starts with it."""
    return GatewayError("INVALID_ARGUMENT", f"{param}: {message}", param)
