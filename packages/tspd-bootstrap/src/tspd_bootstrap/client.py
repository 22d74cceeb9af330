"""`BootstrapClient`: the synchronous client the PD/EPD peers use to reach a bootstrap server.

Works against this package's server and TokenSpeed's (same routes and bodies; only the error
reasons are richer here). No caching: a decode peer caches the parallel info itself.

Retries: a request that cannot reach the server (refused, reset, timed out, or a 502/503/504 from
a proxy) is retried up to ``retries`` times, sleeping ``min(max_backoff, backoff * 2**n)`` halved
plus a uniform jitter of up to the other half ("equal jitter", so retries of many ranks spread
out but never collapse to zero). An HTTP answer is never retried: a 4xx is final, and a
500 (wire.md §3.3) for a rank look-up means "not registered yet": whether to wait or fail the
room is the peer's call (:class:`BootstrapNotFound`).

With a ``credential`` (:class:`~tspd_bootstrap.auth.ClusterCredential`) every request carries
its seal (a fresh one per attempt), which a server holding the same credential requires; a
server without one (or TokenSpeed's) ignores the header.

Threading: a client may be shared by threads; each thread gets its own keep-alive session.
"""

from __future__ import annotations

import json as jsonlib
import random
import threading
import time
import urllib.parse
from collections.abc import Callable
from types import TracebackType
from typing import Any, Self, TypeVar

import requests

from tspd_bootstrap.auth import ClusterCredential, sign_request
from tspd_bootstrap.errors import (
    BootstrapConflict,
    BootstrapNotFound,
    BootstrapProtocolError,
    BootstrapRejected,
    BootstrapRequestError,
    BootstrapUnauthorized,
    BootstrapUnavailable,
)
from tspd_bootstrap.model import DeploymentView, ParallelInfo, RankAddress, Registration, Role
from tspd_bootstrap.wire import (
    deployment_from_json,
    error_from_json,
    parallel_info_from_json,
    rank_address_from_json,
    registration_json,
)

_T = TypeVar("_T")
_TRANSIENT = {502, 503, 504}  # a proxy in front of a restarting server

#: Seconds for one request: one value bounds the connect and each read; a pair is
#: (connect, read), as ``requests`` takes it.
Timeout = float | tuple[float, float]
#: wire.md §3: D's heartbeat probes ``GET /health`` with a 2 s connect and a 3 s read timeout.
HEALTH_TIMEOUT: tuple[float, float] = (2.0, 3.0)


class BootstrapClient:
    """Client of one bootstrap server; ``base_url`` is ``http://host:port`` or ``host:port``.

    ``timeout`` bounds connecting and each read, per attempt. ``trust_env=False`` (default)
    ignores ``HTTP_PROXY``-style variables: the rendezvous is cluster-internal and a proxy set for
    model downloads must not intercept it. ``credential`` seals every request (see the module
    docstring). ``rng`` and ``sleep`` exist for deterministic tests.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 5.0,
        retries: int = 3,
        backoff: float = 0.1,
        max_backoff: float = 2.0,
        trust_env: bool = False,
        credential: ClusterCredential | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if timeout <= 0 or retries < 0 or backoff < 0 or max_backoff < 0:
            raise ValueError("timeout must be > 0; retries, backoff and max_backoff >= 0")
        self.base_url = normalize_url(base_url)
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._trust_env = trust_env
        self._credential = credential
        self._rng = rng or random.Random()
        self._sleep = sleep
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._lock = threading.Lock()

    # ---- the peer API --------------------------------------------------------------------

    def register_rank(
        self,
        *,
        engine_rank: int,
        world_size: int,
        dp_size: int,
        rank_ip: str,
        rank_port: int,
        cache_layout: str | None = None,
        role: Role = Role.PREFILL,
        extensions: tuple[str, ...] = (),
    ) -> None:
        """``PUT /route`` for one data-source rank (global ``engine_rank``; world = TP x DP).

        Pass ``cache_layout`` to a KV server, omit it for an embedding server; ``extensions``
        names the tspd-only protocol extensions the rank speaks (``tspd_extensions``: a tspd
        server hands them to peers looking the rank up, a TokenSpeed one drops them). Raises
        :class:`BootstrapRejected` (400: the reason says which field),
        :class:`BootstrapConflict` (409: sizes or layout differ from the deployment's) or
        :class:`BootstrapUnavailable`.
        """
        reg = Registration(
            Role(role),
            world_size,
            dp_size,
            rank_ip,
            rank_port,
            engine_rank,
            cache_layout,
            tuple(sorted(set(extensions))),
        )
        what = f"PUT /route (engine_rank {engine_rank})"
        self._ok(self._request("PUT", "/route", what, json=registration_json(reg)), what)

    @property
    def credential(self) -> ClusterCredential | None:
        return self._credential

    def parallel_info(self) -> ParallelInfo | None:
        """Parallel sizes (and KV layout); ``None`` before any rank registered."""
        what = "GET /route parallel info"
        resp = self._request("GET", "/route?engine_rank=-1&target_dp_group=-1", what)
        return self._parse(resp, what, parallel_info_from_json)

    def rank_address(self, engine_rank: int, target_dp_group: int) -> RankAddress:
        """Address of TP rank ``engine_rank`` (within its DP group) of ``target_dp_group``.

        Raises :class:`BootstrapNotFound` while the deployment is incomplete (500, wire.md §3.3) and
        :class:`BootstrapRejected` for an out-of-range rank or group.
        """
        path = f"/route?engine_rank={engine_rank}&target_dp_group={target_dp_group}"
        what = f"GET {path}"
        return self._parse(self._request("GET", path, what), what, rank_address_from_json)

    def health(self, timeout: Timeout = HEALTH_TIMEOUT) -> None:
        """One ``GET /health`` (no retries: a heartbeat counts failures itself); raises on any
        failure, naming it.

        ``timeout`` is wire.md §3's heartbeat bound by default: 2 s to connect, 3 s to read (a
        single value bounds both); the client's own ``timeout`` does not apply here.
        """
        what = "GET /health"
        resp = self._request("GET", "/health", what, retries=0, timeout=timeout)
        self._ok(resp, what)

    def is_healthy(self, timeout: Timeout = HEALTH_TIMEOUT) -> bool:
        try:
            self.health(timeout)
        except BootstrapRequestError:
            return False
        return True

    def list_ranks(self) -> DeploymentView:
        """The operator listing (``GET /ranks``; tspd servers only)."""
        what = "GET /ranks"
        return self._parse(self._request("GET", "/ranks", what), what, deployment_from_json)

    def deregister_rank(self, engine_rank: int) -> None:
        """Forget one rank (``DELETE /ranks/<engine_rank>``).

        Raises :class:`BootstrapNotFound` when it is not registered."""
        what = f"DELETE /ranks/{engine_rank}"
        self._ok(self._request("DELETE", f"/ranks/{engine_rank}", what), what)

    def reset(self) -> int:
        """Forget the whole deployment (``DELETE /ranks``); returns how many ranks were removed."""
        what = "DELETE /ranks"
        removed: int = self._parse(self._request("DELETE", "/ranks", what), what, _removed)
        return removed

    def close(self) -> None:
        """Close every thread's session; the client stays usable (sessions are re-made)."""
        with self._lock:
            sessions, self._sessions = self._sessions, []
        for session in sessions:
            session.close()
        self._local = threading.local()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BootstrapClient({self.base_url!r}, timeout={self.timeout}, retries={self.retries})"

    # ---- transport -----------------------------------------------------------------------

    def _session(self) -> requests.Session:
        session: requests.Session | None = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            session.trust_env = self._trust_env
            self._local.session = session
            with self._lock:
                self._sessions.append(session)
        return session

    def _request(
        self,
        method: str,
        path: str,
        what: str,
        *,
        json: object = None,
        retries: int | None = None,
        timeout: Timeout | None = None,
    ) -> requests.Response:
        attempts = 1 + (self.retries if retries is None else retries)
        connect, read = _timeout_pair(self.timeout if timeout is None else timeout)
        body = b"" if json is None else jsonlib.dumps(json).encode()
        failure = "no attempt made"
        for attempt in range(attempts):
            if attempt:
                self._sleep(self._delay(attempt - 1))
            try:
                resp = self._session().request(
                    method,
                    self.base_url + path,
                    data=body or None,
                    headers=self._headers(method, path, body, json is not None),
                    timeout=(connect, read),
                )
            except requests.ConnectTimeout:  # before ConnectionError: it is one too
                failure = f"connect timed out after {connect:g} s"
            except requests.Timeout:
                failure = f"read timed out after {read:g} s"
            except requests.ConnectionError as exc:
                failure = describe_connection_error(exc)
            except requests.RequestException as exc:
                raise BootstrapProtocolError(self.base_url, what, repr(exc)) from exc
            else:
                if resp.status_code not in _TRANSIENT:
                    return resp
                failure = f"{resp.status_code} {resp.reason} from a proxy"
        raise BootstrapUnavailable(
            self.base_url, what, f"{failure} (after {attempts} attempt{'s' * (attempts > 1)})"
        )

    def _headers(self, method: str, path: str, body: bytes, is_json: bool) -> dict[str, str]:
        headers = {"Content-Type": "application/json"} if is_json else {}
        if self._credential is not None:  # a fresh seal per attempt: a retry is no replay
            headers["Authorization"] = sign_request(self._credential, method, path, body)
        return headers

    def _delay(self, retry: int) -> float:
        ceiling = min(self.max_backoff, self.backoff * 2.0**retry)
        return ceiling / 2 + self._rng.uniform(0, ceiling / 2)

    def _ok(self, resp: requests.Response, what: str) -> None:
        if resp.status_code != 200:
            raise self._error(resp, what)

    def _parse(self, resp: requests.Response, what: str, parse: Callable[[Any], _T]) -> _T:
        self._ok(resp, what)
        try:
            return parse(resp.json())
        except ValueError as exc:
            raise BootstrapProtocolError(
                self.base_url, what, f"unusable answer: {exc}", status=resp.status_code
            ) from exc

    def _error(self, resp: requests.Response, what: str) -> BootstrapRequestError:
        code, message = error_from_json(resp.text)
        status = resp.status_code
        args = (self.base_url, what, message)
        if status == 409:
            after = _seconds(resp.headers.get("Retry-After"))
            return BootstrapConflict(*args, status=status, code=code, retry_after=after)
        if status == 401:
            return BootstrapUnauthorized(*args, status=status, code=code)
        if status == 500 and what.startswith("GET /route?"):
            # wire.md §3.3: an unknown (dp, tp), or its DP group incomplete
            return BootstrapNotFound(*args, status=status, code=code)
        if status == 404 and code != "no_such_route":
            return BootstrapNotFound(*args, status=status, code=code)
        if 400 <= status < 500 and status != 404:
            return BootstrapRejected(*args, status=status, code=code)
        return BootstrapProtocolError(*args, status=status, code=code)


def _timeout_pair(timeout: Timeout) -> tuple[float, float]:
    """(connect, read) seconds from one value or a pair; ValueError unless both are > 0."""
    pair = timeout if isinstance(timeout, tuple) else (timeout, timeout)
    valid = [isinstance(t, int | float) and not isinstance(t, bool) and t > 0 for t in pair]
    if len(pair) != 2 or not all(valid):
        raise ValueError(
            f"timeout must be seconds > 0 or a (connect, read) pair of them, got {timeout!r}"
        )
    return float(pair[0]), float(pair[1])


def normalize_url(base_url: str) -> str:
    """``host:port`` or ``http://host:port[/]`` → ``http://host:port``; ValueError otherwise."""
    text = base_url.strip()
    if "://" not in text:
        text = "http://" + text
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"bootstrap server address {base_url!r} is not http://host:port")
    if parts.query or parts.fragment or parts.path.strip("/"):
        raise ValueError(f"bootstrap server address {base_url!r} must not carry a path or query")
    try:
        parts.port  # noqa: B018 - property raises on a bad port
    except ValueError as exc:
        raise ValueError(f"bootstrap server address {base_url!r}: {exc}") from exc
    return f"{parts.scheme}://{parts.netloc}"


def describe_connection_error(exc: BaseException) -> str:
    """The innermost OS-level reason of a requests/urllib3 connection error, in plain words."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        cur = todo.pop(0)
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.strerror:
            return cur.strerror.lower()
        nexts = [getattr(cur, "reason", None), cur.__cause__, cur.__context__, *cur.args]
        todo.extend(n for n in nexts if isinstance(n, BaseException))
    return str(exc)[:300] or type(exc).__name__


def _seconds(header: str | None) -> float | None:
    """A ``Retry-After`` of delta-seconds (the only form the bootstrap server sends)."""
    return float(header) if header is not None and header.isdigit() else None


def _removed(body: Any) -> int:
    removed = body.get("removed") if isinstance(body, dict) else None
    if isinstance(removed, bool) or not isinstance(removed, int):
        raise ValueError("expected {'removed': <int>}")
    return removed
