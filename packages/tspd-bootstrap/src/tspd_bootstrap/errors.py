"""The exception hierarchy of tspd_bootstrap.

Every error raised on purpose derives from :class:`BootstrapError` and also from the builtin that
matches its meaning, so callers may catch either:

* server side: :class:`RegistrationError` (``ValueError``) carries the HTTP status and a stable
  reason code; the registry raises it and the HTTP layer turns it into the response.
* lifecycle: :class:`BindError` (``OSError``) when the server cannot bind,
  :class:`ShutdownError` (``RuntimeError``) when it does not stop in time.
* client side: :class:`BootstrapRequestError` and its subclasses name the server, the request and
  what failed (status code and the server's reason).

This package cannot import ``tspd_core`` (``tspd_core`` depends on it), so the hierarchy is rooted
here rather than at ``tspd_core.errors.TspdError``.
"""

from __future__ import annotations

from collections.abc import Mapping


class BootstrapError(Exception):
    """Base of every error tspd_bootstrap raises on purpose."""


class RegistrationError(BootstrapError, ValueError):
    """A request the server refuses; ``status`` is the HTTP status, ``code`` a stable reason,
    ``headers`` extra response headers (``Retry-After``, ``WWW-Authenticate``)."""

    def __init__(
        self, status: int, code: str, message: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers: Mapping[str, str] = headers or {}


class BindError(BootstrapError, OSError):
    """The server could not bind its address (taken port, bad host, bind timeout)."""


class ShutdownError(BootstrapError, RuntimeError):
    """The server thread did not stop within its close timeout, or was misused."""


class BootstrapRequestError(BootstrapError):
    """A client request failed. Names the server, the request and what went wrong.

    ``status`` is the HTTP status when the server answered (``None`` when it could not be
    reached), ``code`` the server's reason code when it sent one (``None`` otherwise),
    ``retry_after`` the seconds of its ``Retry-After`` header (a rank held under a lease).
    """

    def __init__(
        self,
        server: str,
        request: str,
        reason: str,
        *,
        status: int | None = None,
        code: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        if status is None:
            shown = reason
        elif code:
            shown = f"{status} {code}: {reason}"
        else:
            shown = f"{status}: {reason}"
        super().__init__(f"bootstrap server {server}: {request} failed: {shown}")
        self.server = server
        self.request = request
        self.reason = reason
        self.status = status
        self.code = code
        self.retry_after = retry_after


class BootstrapUnavailable(BootstrapRequestError, ConnectionError):
    """The server could not be reached (refused, reset, timed out) after all retries."""


class BootstrapRejected(BootstrapRequestError, ValueError):
    """The server refused the request as bad input (4xx other than 409)."""


class BootstrapConflict(BootstrapRejected):
    """The registration conflicts with the deployment already registered, or its engine rank
    is held by another address (409)."""


class BootstrapUnauthorized(BootstrapRejected):
    """The server requires the cluster credential and the request's seal was missing or did
    not verify (401)."""


class BootstrapNotFound(BootstrapRequestError, LookupError):
    """The looked-up rank is not (yet) registered, or its DP group is incomplete (a 500,
    wire.md §3.3)."""


class BootstrapProtocolError(BootstrapRequestError, RuntimeError):
    """The server answered with something this client cannot use (bad JSON, wrong types, 5xx)."""
