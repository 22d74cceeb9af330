"""Errors of the router, rooted at :class:`tspd_core.errors.TspdError` and at the front
doors' :class:`~tspd_serving.openai.errors.ApiError`.

Every error the router answers with carries its HTTP status, a machine-readable ``cause``
(the label of ``tspd_router_errors_total``) and the OpenAI error ``type``, so one place turns
it into OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``. A request's
own faults (:class:`BadRequest`, :class:`UnknownModel`) are the OpenAI layer's
(:mod:`tspd_serving.openai.errors`, shared with the nodes' ``/v1`` routes); what only a router
meets (no node, a node's failure, a timeout) is a :class:`RouterError`.
"""

from __future__ import annotations

from tspd_core.errors import TspdError
from tspd_serving.openai.errors import ApiError, BadRequest, UnknownModel

__all__ = [
    "ApiError",
    "BadRequest",
    "BodyRefused",
    "Internal",
    "NoRoute",
    "Overloaded",
    "RouterError",
    "TimedOut",
    "Unavailable",
    "UnknownModel",
    "UpstreamFailed",
]


class RouterError(ApiError, TspdError):
    """Base of the errors only a router answers with."""


class NoRoute(RouterError, BadRequest):
    """The path (404) or the method (405) is not part of this router's API."""

    def __init__(self, method: str, path: str, status: int) -> None:
        what = "method" if status == 405 else "route"
        BadRequest.__init__(
            self,
            f"no {what} {method} {path[:200]} here; this router serves POST /v1/completions, "
            "POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics and "
            "GET /openapi.json",
            cause="not_found" if status == 404 else "method_not_allowed",
        )
        self.status = status


class BodyRefused(RouterError, BadRequest):
    """The body was refused before parsing: 400 malformed, 408 too slow, 413 too large."""

    def __init__(self, status: int, message: str) -> None:
        causes = {408: "body_timeout", 413: "body_too_large"}
        BadRequest.__init__(self, message, cause=causes.get(status, "bad_request"))
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
