"""`BootstrapServer`: the bootstrap HTTP server in its own thread and event loop.

Used standalone (the ``tspd-bootstrap`` CLI) and embedded in a prefill (or encode) rank's process::

    with BootstrapServer("10.0.0.2", 8998, layout_canonicalizer=strict_parser) as server:
        ...                       # ranks PUT to server.url; decode ranks GET from it

    caller thread                     server thread ("tspd-bootstrap-<port>")
    ─────────────                     ──────────────────────────────────────
    start() ── spawn ───────────────► bind socket, start aiohttp on its own loop
            ◄── ready / bind error ── (the caller waits up to bind_timeout)
    close() ── stop event ──────────► stop site, drain handlers, close loop
            ◄── join (close_timeout)

Threading: ``start``/``close``/``snapshot`` may be called from any thread except the server's
own; ``close`` is idempotent. A closed server cannot be restarted: make a new one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Self

from aiohttp import web
from aiohttp.log import access_logger

from tspd_bootstrap.app import BootstrapApp
from tspd_bootstrap.auth import ClusterCredential
from tspd_bootstrap.errors import BindError, ShutdownError
from tspd_bootstrap.layout import LayoutCanonicalizer, default_canonicalizer
from tspd_bootstrap.model import DeploymentView, ServerKind
from tspd_bootstrap.registry import DEFAULT_LEASE_S

DEFAULT_PORT = 8998  # wire.md §3: --disaggregation-bootstrap-port
BIND_TIMEOUT_S = 10.0  # wire.md §8: bootstrap bind wait
CLOSE_TIMEOUT_S = 5.0  # wire.md §8: bootstrap stop wait
#: A connection must finish a request's headers within this many seconds of opening (or of its
#: previous answer, which also closes idle keep-alive connections): slow senders cannot hold
#: connections open. Above the client's own keep-alive (requests' pools reuse sockets briefly).
HEADER_TIMEOUT_S = 15.0
#: A PUT /route body must arrive within this many seconds (answered 408 otherwise).
BODY_TIMEOUT_S = 10.0
_WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


class BootstrapServer:
    """The rendezvous HTTP server (routes in :mod:`tspd_bootstrap.app`).

    ``embedding=True`` makes the EPD embedding server (no ``cache_layout``); otherwise it is the
    KV server, which canonicalises every registered layout with ``layout_canonicalizer``
    (default: tspd_core's strict contract form, :mod:`tspd_bootstrap.layout`; ``ValueError``
    when it cannot be loaded) and demands the same canonical text from all ranks. ``port=0``
    lets the OS choose; :attr:`port` holds the bound port once :meth:`start` returns.
    The operator ``DELETE /ranks`` endpoints answer 403 unless ``allow_admin=True``. ``host``
    is the one address the server listens on (loopback by default; a wildcard only when the
    caller asks for it).
    ``header_timeout`` and ``body_timeout`` bound how long a client may take to send a
    request's headers (or stay idle) and its body. ``credential`` (a
    :class:`~tspd_bootstrap.auth.ClusterCredential`) makes ``/route`` and ``/ranks`` require
    its seal (401 otherwise). ``lease_s``: how long a renewing rank holds its address after
    its last registration (a registration from another address is a 409 until then).
    ``clock`` (Unix seconds) exists for tests.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        embedding: bool = False,
        layout_canonicalizer: LayoutCanonicalizer | None = None,
        bind_timeout: float = BIND_TIMEOUT_S,
        close_timeout: float = CLOSE_TIMEOUT_S,
        allow_admin: bool = False,
        access_log: bool = False,
        header_timeout: float = HEADER_TIMEOUT_S,
        body_timeout: float = BODY_TIMEOUT_S,
        credential: ClusterCredential | None = None,
        lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"port {port} is not a TCP port (0..65535; 0 = OS-chosen)")
        if header_timeout <= 0 or body_timeout <= 0:
            raise ValueError("the header and body timeouts must be > 0 s")
        self.header_timeout = header_timeout
        self.host = host
        self.port = port
        self.kind = ServerKind.EMBEDDING if embedding else ServerKind.KV
        self.bind_timeout = bind_timeout
        self.close_timeout = close_timeout
        if layout_canonicalizer is None and self.kind is ServerKind.KV:
            layout_canonicalizer = default_canonicalizer()
        self.credential = credential
        self._app = BootstrapApp(
            self.kind,
            layout_canonicalizer,
            allow_admin=allow_admin,
            body_timeout=body_timeout,
            credential=credential,
            lease_s=lease_s,
            clock=clock,
        )
        self._access_log = access_log
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = asyncio.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._closed = False

    @property
    def url(self) -> str:
        """Base URL for clients on this host (a wildcard bind address maps to loopback)."""
        host = _WILDCARDS.get(self.host, self.host)
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{self.port}"

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive() and self._ready.is_set()

    def start(self) -> Self:
        """Bind and serve in a new thread; return once serving (no-op if already serving).

        Raises :class:`BindError` (e.g. ``address already in use: 127.0.0.1:8998``) when the
        address cannot be bound or binding takes longer than ``bind_timeout``.
        """
        with self._lock:
            if self._closed:
                raise ShutdownError("this bootstrap server was closed; create a new one")
            if self._thread is not None:
                return self
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._run, name=f"tspd-bootstrap-{self.port}", daemon=True
            )
            self._thread.start()
        if not self._ready.wait(self.bind_timeout):
            self._abandon()
            raise BindError(
                f"bootstrap server did not bind {self.host}:{self.port} "
                f"within {self.bind_timeout:.1f} s"
            )
        if self._error is not None:
            self._abandon()
            raise self._error
        return self

    def close(self) -> None:
        """Stop serving and wait (up to ``close_timeout``) for the thread; idempotent."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is None:
            return
        if threading.current_thread() is thread:
            raise ShutdownError("close() called from the server's own thread would deadlock")
        self._request_stop()
        thread.join(self.close_timeout)
        if thread.is_alive():
            raise ShutdownError(
                f"bootstrap server {self.url} did not stop within {self.close_timeout:.1f} s"
            )

    def snapshot(self) -> DeploymentView:
        """The registry as the operator listing shows it, read on the server's loop."""
        loop = self._loop
        if loop is None or not self.running:
            raise ShutdownError("the bootstrap server is not running")
        done: concurrent.futures.Future[DeploymentView] = concurrent.futures.Future()

        def read() -> None:
            try:
                done.set_result(self._app.registry.snapshot())
            except BaseException as exc:  # handed to the caller's thread
                done.set_exception(exc)

        loop.call_soon_threadsafe(read)
        return done.result(timeout=self.close_timeout)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "closed" if self._closed else "idle"
        return f"BootstrapServer({self.kind.value}, {self.host}:{self.port}, {state})"

    def _abandon(self) -> None:
        with self._lock:
            self._closed = True
        self._request_stop()
        if self._thread is not None:
            self._thread.join(self.close_timeout)

    def _request_stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._stop.set)
        except RuntimeError:
            pass  # the loop already closed: the thread is on its way out

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to start(), or logged by the thread hook
            if not self._ready.is_set():
                self._error = BindError(f"bootstrap server failed to start: {exc!r}")
                self._error.__cause__ = exc
            else:
                raise
        finally:
            self._ready.set()
            loop.close()

    async def _serve(self) -> None:
        try:
            sock = _bind(self.host, self.port)
        except OSError as exc:
            self._error = _bind_error(self.host, self.port, exc)
            return
        runner = web.AppRunner(
            self._app.build(),
            access_log=access_logger if self._access_log else None,
            shutdown_timeout=max(0.1, self.close_timeout / 2),
            keepalive_timeout=self.header_timeout,  # aiohttp's header and idle deadline
            lingering_time=1.0,  # a refused body: read on 1 s at most (aiohttp: 10 s)
        )
        try:
            await runner.setup()
            await web.SockSite(runner, sock).start()
            self.port = sock.getsockname()[1]
            self._ready.set()
            await self._stop.wait()
        finally:
            await runner.cleanup()
            sock.close()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET
    if host:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family = infos[0][0]
    dual = family == socket.AF_INET6 and host == "::" and socket.has_dualstack_ipv6()
    sock = socket.create_server((host, port), family=family, backlog=1024, dualstack_ipv6=dual)
    sock.setblocking(False)
    return sock


def _bind_error(host: str, port: int, exc: OSError) -> BindError:
    if isinstance(exc, socket.gaierror):
        err = BindError(f"cannot resolve bootstrap bind host {host!r}: {exc.strerror or exc}")
    elif exc.errno == errno.EADDRINUSE:
        err = BindError(f"address already in use: {host}:{port}")
    elif exc.errno in (errno.EACCES, errno.EPERM):
        err = BindError(f"permission denied binding {host}:{port}")
    else:
        err = BindError(f"cannot bind {host}:{port}: {exc.strerror or exc}")
    err.errno = exc.errno  # one-argument OSError keeps str() to the message alone
    err.__cause__ = exc
    return err
