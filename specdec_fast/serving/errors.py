"""The error a server answers a refused request with, in OpenAI's error shape."""

from __future__ import annotations


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class RequestError(ValueError):
    """A request the server refuses: `status` (400 by default) with OpenAI's error body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = (
            message,
            param,
            code,
            status,
            kind,
        )

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)
