"""Errors of the router, rooted at :class:`tspd_core.errors.TspdError`.

Every error the router answers with carries its HTTP status, a machine-readable ``cause``
(the label of ``tspd_router_errors_total``) and the OpenAI error ``type``, so one place turns
it into OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any

from tspd_core.errors import TspdError


class RouterError(TspdError):
    """Base of every error the router answers with."""

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


class BadRequest(RouterError, ValueError):
    """The client's request is malformed or asks for something this deployment cannot do."""

    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, cause: str = "bad_request") -> None:
        super().__init__(message, cause, param)


class UnknownModel(BadRequest):
    status = 404

    def __init__(self, model: str, served: str) -> None:
        super().__init__(
            f"the model {model!r} does not exist here; this router serves {served!r}",
            "model",
            "model_not_found",
        )


class NoRoute(BadRequest):
    """The path (404) or the method (405) is not part of this router's API."""

    def __init__(self, method: str, path: str, status: int) -> None:
        what = "method" if status == 405 else "route"
        super().__init__(
            f"no {what} {method} {path[:200]} here; this router serves POST /v1/completions, "
            "POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics and "
            "GET /openapi.json",
            cause="not_found" if status == 404 else "method_not_allowed",
        )
        self.status = status


class BodyRefused(BadRequest):
    """The body was refused before parsing: 400 malformed, 408 too slow, 413 too large."""

    def __init__(self, status: int, message: str) -> None:
        causes = {408: "body_timeout", 413: "body_too_large"}
        super().__init__(message, cause=causes.get(status, "bad_request"))
        self.status = status


class Internal(RouterError, RuntimeError):
    """A bug: the router failed a request it should have answered (logged with the trace)."""

    status = 500

    def __init__(self) -> None:
        super().__init__("internal error; see the router's log", "internal_error")


class Unavailable(RouterError, RuntimeError):
    """No healthy node can take the request now (retry later)."""

    status = 503
    kind = "service_unavailable"


class Overloaded(RouterError, RuntimeError):
    """Every node that could take the request is at capacity (their admission control
    refused it): 429 with ``Retry-After``, the longest any of them asked for."""

    status = 429
    kind = "overloaded"

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message, "overloaded")
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class UpstreamFailed(RouterError, RuntimeError):
    """A node failed the request: a KV transfer failed, a node died or broke the stream."""

    status = 502


class TimedOut(RouterError, RuntimeError):
    status = 504
    kind = "timeout"
