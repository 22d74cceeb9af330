"""Errors a front door answers with, in OpenAI's shape, rooted at the serving errors.

Every :class:`ApiError` carries its HTTP status, a machine-readable ``cause`` (OpenAI's
``code``; the router's ``tspd_router_errors_total`` label) and OpenAI's error ``type``, so one
place turns it into the body ``{"error": {"message", "type", "param", "code"}}``. The router's
own errors (``tspd_router.errors``) derive from it too.
"""

from __future__ import annotations

from typing import Any

from tspd_serving.errors import ServingError


class ApiError(ServingError):
    """Base of every error a front door answers with (status 500 unless a subclass says)."""

    status = 500
    kind = "server_error"

    def __init__(self, message: str, cause: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.cause = cause
        self.param = param

    def headers(self) -> dict[str, str]:
        """Headers the error response carries beside its body."""
        return {}

    def body(self) -> dict[str, Any]:
        """OpenAI's error shape."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.cause,
            }
        }


class BadRequest(ApiError, ValueError):
    """The client's request is malformed or asks for something this deployment cannot do."""

    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, cause: str = "bad_request") -> None:
        super().__init__(message, cause, param)


class UnknownModel(BadRequest):
    status = 404

    def __init__(self, model: str, served: str) -> None:
        super().__init__(
            f"the model {model!r} does not exist here; the served model is {served!r}",
            "model",
            "model_not_found",
        )
