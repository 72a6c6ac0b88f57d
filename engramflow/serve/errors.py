"""OpenAI's error bodies: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, TYPES.get(self.status, "error"), self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)
