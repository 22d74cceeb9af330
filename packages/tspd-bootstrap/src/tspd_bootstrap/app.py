"""The bootstrap server's HTTP routes (aiohttp), over one :class:`Registry` and its metrics.

=========================  ===============================================================
route                      answer
=========================  ===============================================================
``PUT /route``             register a rank: 200 ``OK``; 400 bad input; 409 conflict or the rank
                           is held by another address; 413 size
``GET /route``             parallel info (``-1/-1``) or a rank's address; 400; 500 not yet
                           (the asked-for DP group has a rank missing)
other method on /route     405
``GET /health``            200 ``OK``
``GET /metrics``           Prometheus text
``GET /ranks``             the operator listing (JSON)
``DELETE /ranks``          forget the deployment (redeploy); 403 when admin is off
``DELETE /ranks/<rank>``   forget one rank; 404 when it is not registered
=========================  ===============================================================

Every refusal is a JSON body ``{"status", "error" (reason code), "message"}``; a handler that
fails unexpectedly answers 500 ``internal`` and is logged, and the registry is left as it was
(it changes only in :meth:`Registry.register` / ``deregister`` / ``reset``, after validation).

With a cluster credential (:mod:`tspd_bootstrap.auth`), ``/route`` and ``/ranks`` answer 401
unless the request carries a valid seal (the ones that change the registry also a fresh one);
a sealed registration may replace a rank whose holder is still registered. ``/health`` and
``/metrics`` stay open.

Threading: all handlers, the registry and the metrics run on the server's one event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from aiohttp import web
from aiohttp.typedefs import Handler

from tspd_bootstrap.auth import (
    HTTP_SCHEME,
    ClusterCredential,
    CredentialError,
    ReplayGuard,
    check_request,
)
from tspd_bootstrap.errors import RegistrationError
from tspd_bootstrap.layout import LayoutCanonicalizer
from tspd_bootstrap.metrics import Gauges, Metrics
from tspd_bootstrap.model import ParallelInfo, Registration, ServerKind
from tspd_bootstrap.registry import DEFAULT_LEASE_S, Outcome, Registry
from tspd_bootstrap.version import __version__
from tspd_bootstrap.wire import (
    MAX_BODY_BYTES,
    PARALLEL_INFO,
    bad,
    decode_json,
    deployment_json,
    error_json,
    parallel_info_json,
    parse_registration,
    parse_route_query,
    rank_address_json,
)

log = logging.getLogger("tspd_bootstrap.server")
_RANK_PATH = re.compile(r"[0-9]{1,6}")
_PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
_JSON = "application/json"


class BootstrapApp:
    """Handlers, registry and metrics of one server. See the module docstring."""

    def __init__(
        self,
        kind: ServerKind,
        canonicalizer: LayoutCanonicalizer | None,
        *,
        allow_admin: bool = False,
        clock: Callable[[], float] = time.time,
        body_timeout: float = 10.0,
        credential: ClusterCredential | None = None,
        lease_s: float = DEFAULT_LEASE_S,
    ) -> None:
        self.kind = kind
        self.registry = Registry(kind, lease_s)
        self.metrics = Metrics(kind, clock(), __version__)
        self._canonicalize = canonicalizer
        self._allow_admin = allow_admin
        self._credential = credential
        self._replays = ReplayGuard()
        self._clock = clock
        self._body_timeout = body_timeout
        self._info_cache: tuple[ParallelInfo | None, bytes] = (None, b"")

    def build(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._guard])
        app.router.add_route("*", "/route", self._route)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/ranks", self._ranks)
        app.router.add_delete("/ranks", self._reset)
        app.router.add_delete("/ranks/{engine_rank}", self._deregister)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Turn every refusal into a counted JSON error; nothing escapes as a bare 500."""
        try:
            return await handler(request)
        except RegistrationError as err:
            return self._refuse(request, err)
        except web.HTTPException as exc:  # the router's 404/405 and aiohttp's own limits
            code = _HTTP_CODES.get(exc.status, "http_error")
            refusal = RegistrationError(exc.status, code, _http_message(request, exc))
            return self._refuse(request, refusal, exc.headers)
        except ConnectionError:
            raise  # the client went away; aiohttp closes the transport
        except Exception:
            log.exception("bootstrap handler failed on %s %s", request.method, request.path)
            internal = RegistrationError(500, "internal", "internal error; see the server log")
            return self._refuse(request, internal)

    def _refuse(
        self,
        request: web.Request,
        err: RegistrationError,
        headers: Mapping[str, str] | None = None,
    ) -> web.Response:
        self.metrics.refused(err.status, err.code)
        level = logging.DEBUG if err.code == "not_ready" else logging.WARNING
        log.log(
            level,
            "refused %s %s from %s: %d %s: %s",
            request.method,
            request.path_qs[:200],
            request.remote,
            err.status,
            err.code,
            err.message,
        )
        response = web.json_response(error_json(err), status=err.status)
        if err.status in (408, 413):
            response.force_close()  # the rest of the body is not worth waiting for
        if headers is not None and "Allow" in headers:
            response.headers["Allow"] = headers["Allow"]
        response.headers.update(err.headers)
        return response

    async def _route(self, request: web.Request) -> web.StreamResponse:
        if request.method == "PUT":
            return await self._put(request)
        if request.method == "GET":
            return self._get(request)
        raise web.HTTPMethodNotAllowed(request.method, ["GET", "PUT"])

    async def _put(self, request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            raise bad(
                "too_large",
                f"body is {request.content_length} bytes; the limit is {MAX_BODY_BYTES}",
                413,
            )
        try:
            async with asyncio.timeout(self._body_timeout):
                raw = await request.read()
        except TimeoutError:
            raise bad(
                "slow_body", f"the body did not arrive within {self._body_timeout:g} s", 408
            ) from None
        trusted = self._authenticate(request, raw, fresh=True)
        reg = parse_registration(decode_json(raw), self.kind)
        if reg.cache_layout is not None:
            reg = replace(reg, cache_layout=self._canonical(reg.cache_layout))
        outcome = self._register(reg, trusted)
        log.info(
            "%s %s engine_rank %d (dp %d, tp %d) at %s:%d",
            outcome.value,
            reg.role.value,
            reg.engine_rank,
            reg.dp_group,
            reg.tp_rank,
            reg.rank_ip,
            reg.rank_port,
        )
        return web.Response(text="OK")

    def _register(self, reg: Registration, trusted: bool) -> Outcome:
        """Store ``reg`` and count it; a refused replacement under a lease gets the lease's
        seconds left as ``Retry-After`` (when trying again can succeed without an operator)."""
        now = self._clock()
        before = self.registry.entry(reg.engine_rank)
        held = self.registry.holder(reg, now)
        try:
            outcome = self.registry.register(reg, now, trusted=trusted)
        except RegistrationError as err:
            left = None if held is None else self.registry.lease_left(held, now)
            if err.code == "rank_held" and left is not None:
                err.headers = {"Retry-After": str(max(1, math.ceil(left)))}
            raise
        self.metrics.registered(
            reg.role,
            again=outcome is not Outcome.NEW,
            redeployed=outcome is Outcome.REDEPLOYED,
        )
        old = None if before is None else f"{before.rank_ip}:{before.rank_port}"
        if old is not None and old != f"{reg.rank_ip}:{reg.rank_port}":
            self._replaced(reg, old, held is not None)
        return outcome

    def _replaced(self, reg: Registration, old: str, held: bool) -> None:
        how = "credential" if held else "lease_lapsed"
        self.metrics.replaced(how)
        log.warning(
            "engine_rank %d moved from %s to %s:%d (%s)",
            reg.engine_rank,
            old,
            reg.rank_ip,
            reg.rank_port,
            "a sealed registration" if held else "its lease had lapsed",
        )

    def _authenticate(self, request: web.Request, body: bytes, *, fresh: bool) -> bool:
        """Whether ``request`` is sealed with the cluster credential (False without one).

        With a credential, a missing or bad seal is a 401; ``fresh`` (requests that change the
        registry) also refuses a seal used before (a replay).
        """
        if self._credential is None:
            return False
        now = self._clock()
        header = request.headers.get("Authorization")
        try:
            seal = check_request(
                self._credential, request.method, request.raw_path, body, header, now
            )
            if fresh:
                self._replays.admit(seal, now)
        except CredentialError as exc:
            what = f"{request.method} {request.path}"
            challenge = {"WWW-Authenticate": HTTP_SCHEME}
            raise RegistrationError(401, exc.code, f"{what}: {exc.message}", challenge) from exc
        return True

    def _canonical(self, layout: str) -> str:
        if self._canonicalize is None:
            raise TypeError(f"a {self.kind} server was given a layout but has no canonicaliser")
        try:
            canonical = self._canonicalize(layout)
        except Exception as exc:
            # Whatever the (injected) canonicaliser raises is its verdict on client input.
            raise bad("bad_layout", f"cache_layout rejected: {exc}") from exc
        if not isinstance(canonical, str):
            raise TypeError(f"layout canonicalizer returned {type(canonical).__name__}, not str")
        return canonical

    def _get(self, request: web.Request) -> web.Response:
        self._authenticate(request, b"", fresh=False)
        names = ("engine_rank", "target_dp_group")
        tp_rank, dp_group = parse_route_query({n: request.query.getall(n, []) for n in names})
        if tp_rank == PARALLEL_INFO and dp_group == PARALLEL_INFO:
            info = self.registry.parallel_info()
            self.metrics.looked_up("parallel_info", hit=info is not None)
            body = self._parallel_info_body(info)
            return web.Response(body=body, content_type=_JSON, charset="utf-8")
        address = self.registry.lookup(tp_rank, dp_group)
        self.metrics.looked_up("rank", hit=address is not None)
        if address is None:
            raise RegistrationError(500, "not_ready", self._not_ready(tp_rank, dp_group))
        return web.json_response(rank_address_json(address))

    def _parallel_info_body(self, info: ParallelInfo | None) -> bytes:
        # Every decode rank fetches this, and a layout can be 256 KiB: encode it once per
        # deployment change, not once per request (the comparison is by identity first).
        cached_info, cached_body = self._info_cache
        if cached_body and cached_info == info:
            return cached_body
        body = json.dumps(parallel_info_json(info, self.kind)).encode()
        self._info_cache = (info, body)
        return body

    def _not_ready(self, tp_rank: int, dp_group: int) -> str:
        asked = f"engine_rank {tp_rank} of target_dp_group {dp_group}"
        if self.registry.parallel_info() is None:
            return f"{asked}: no rank has registered yet; retry later"
        missing = self.registry.group_missing(dp_group)
        shown = ", ".join(str(r) for r in missing[:8])
        return (
            f"{asked}: DP group {dp_group} is incomplete (missing engine_rank {shown}"
            f"{' ...' if len(missing) > 8 else ''}); retry later"
        )

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _metrics(self, request: web.Request) -> web.Response:
        reg = self.registry
        text = self.metrics.render(Gauges(reg.registered, reg.expected, reg.complete))
        return web.Response(body=text.encode(), headers={"Content-Type": _PROMETHEUS})

    async def _ranks(self, request: web.Request) -> web.Response:
        self._authenticate(request, b"", fresh=False)
        return web.json_response(deployment_json(self.registry.snapshot()))

    async def _reset(self, request: web.Request) -> web.Response:
        self._authenticate(request, b"", fresh=True)
        self._check_admin()
        removed = self.registry.reset()
        self.metrics.deregistrations += removed
        log.warning("deployment reset by %s: %d rank(s) forgotten", request.remote, removed)
        return web.json_response({"removed": removed})

    async def _deregister(self, request: web.Request) -> web.Response:
        self._authenticate(request, b"", fresh=True)
        self._check_admin()
        text = request.match_info["engine_rank"]
        if not _RANK_PATH.fullmatch(text):
            raise bad("bad_query", f"engine rank must be a non-negative integer, got {text[:40]!r}")
        entry = self.registry.deregister(int(text))
        if entry is None:
            raise bad("not_registered", f"engine_rank {int(text)} is not registered", 404)
        self.metrics.deregistrations += 1
        log.warning("engine_rank %d deregistered by %s", entry.engine_rank, request.remote)
        return web.json_response({"removed": 1})

    def _check_admin(self) -> None:
        if not self._allow_admin:
            raise bad("admin_disabled", "operator endpoints are disabled on this server", 403)


def _http_message(request: web.Request, exc: web.HTTPException) -> str:
    what = f"{request.method} {request.path}"
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return f"{what}: method not allowed (allowed: {', '.join(sorted(exc.allowed_methods))})"
    if isinstance(exc, web.HTTPRequestEntityTooLarge):  # a chunked body grew past the limit
        return f"{what}: body is over the limit of {MAX_BODY_BYTES} bytes"
    if isinstance(exc, web.HTTPNotFound):
        return f"{what}: no such route (routes: /route, /health, /metrics, /ranks)"
    return f"{what}: {exc.reason}"


_HTTP_CODES = {
    400: "bad_request",
    404: "no_such_route",
    405: "method_not_allowed",
    413: "too_large",
}
