"""`ApiError`: an HTTP error answered in the OpenAI error shape, ``{"error": {"message", "type", "param", "code"}}``.

The `openai` client turns the status into its exception class (400 `BadRequestError`, 404 `NotFoundError`, 429
`RateLimitError`, 503 `InternalServerError`, ...) and shows `message`; `param` names the request field at fault.
"""

from __future__ import annotations

# status -> the OpenAI error "type" the official API uses for it
_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_exceeded",
          500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error answer: the HTTP status, a message saying what was wrong and what to do, and the field at fault.

    Args:
        status (`int`): the HTTP status (4xx: the request's fault; 5xx: the server's).
        message (`str`): what was wrong, naming the value received and what is allowed.
        param (`str`, *optional*): the request field at fault (``"max_tokens"``, ``"messages[0].content"``).
        code (`str`, *optional*): a machine-readable code (``"model_not_found"``, ``"context_length_exceeded"``).
        headers (`dict[str, str]`, *optional*): extra response headers (``Retry-After`` for 429 and 503).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status  # HTTP status; fixed
        self.message = message  # fixed
        self.param = param  # the field at fault, or None; fixed
        self.code = code  # fixed
        self.headers = headers or {}  # fixed

    def body(self) -> dict:
        """The JSON body, as OpenAI's API answers errors."""
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400: the request is malformed or asks for something this server cannot do."""
    return ApiError(400, message, param, code)


__all__ = ["ApiError", "bad_request"]
