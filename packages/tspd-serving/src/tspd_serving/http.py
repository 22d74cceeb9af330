"""What every HTTP server of the apps (a node's endpoint, the router) does before a handler
trusts a request: time limits on headers, bodies and idle connections, and a JSON body reader
that bounds size and depth and refuses what cannot be text.

A body comes from anyone who can reach the port, so :func:`read_json` reads it under a
deadline, refuses more than ``max_body_bytes``, JSON nested deeper than ``max_depth`` (the
parser would otherwise recurse once per level: ``[[[[...`` 100,000 deep), invalid UTF-8 and
strings holding lone surrogates (``"\\ud800"`` parses, but no tokenizer can encode it), each
with a :class:`BodyError` carrying the HTTP status and a one-line reason. Each server turns it
into its own error shape.

Time limits (:class:`HttpLimits`): a connection must finish a request's headers within
``header_timeout_s`` of opening (or of its previous response: the same clock closes idle
keep-alive connections), and a body must arrive within ``body_timeout_s``. aiohttp's
keep-alive timer is the header and idle limit (it closes a connection still waiting for a
complete request line and headers when it fires); :func:`read_json` keeps the body's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from tspd_serving.errors import ConfigError

#: What a client of these servers may keep idle; their own clients' keep-alive is shorter
#: (the router's towards the nodes: :data:`CLIENT_KEEPALIVE_S`), so a server never closes a
#: connection the client is about to reuse.
HEADER_TIMEOUT_S = 15.0
BODY_TIMEOUT_S = 30.0
CLIENT_KEEPALIVE_S = 5.0
MAX_BODY_BYTES = 16 << 20
MAX_DEPTH = 32
#: After answering a request whose body it did not read whole, a server keeps reading (and
#: dropping) it this long, so the client sees the answer rather than a reset, then closes.
LINGER_S = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpLimits:
    """One server's limits (see the module docstring)."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    max_body_bytes: int = MAX_BODY_BYTES
    max_depth: int = MAX_DEPTH

    def __post_init__(self) -> None:
        if self.header_timeout_s <= 0 or self.body_timeout_s <= 0:
            raise ValueError("HTTP header and body timeouts must be > 0 s")
        if self.max_body_bytes < 1 or self.max_depth < 2:
            raise ValueError("the body limit must be >= 1 byte and the depth >= 2")

    def runner_kwargs(self) -> dict[str, Any]:
        """Keywords for ``web.AppRunner`` that apply the header and idle limit, and read what
        is left of an unread body (a refused or timed-out one) for at most
        :data:`LINGER_S` before closing (aiohttp's default is 10 s of a slow sender)."""
        return {"keepalive_timeout": self.header_timeout_s, "lingering_time": LINGER_S}


class BodyError(ValueError):
    """A request body refused before any handler looked at it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_json(request: web.Request, limits: HttpLimits) -> Any:
    """The request's JSON body, checked as the module docstring says (:class:`BodyError`)."""
    declared = request.content_length
    if declared is not None and declared > limits.max_body_bytes:
        raise _too_large(declared, limits)
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            raw = await _read(request, limits)
    except TimeoutError:
        why = f"the body did not arrive within {limits.body_timeout_s:g} s"
        raise BodyError(408, why) from None
    try:
        body = json.loads(raw.decode("utf-8"))
    except RecursionError:
        why = f"the body is nested more than {limits.max_depth} levels deep"
        raise BodyError(400, why) from None
    except UnicodeDecodeError:
        raise BodyError(400, "the body is not valid UTF-8") from None
    except ValueError as exc:  # JSONDecodeError
        raise BodyError(400, f"the body is not valid JSON: {exc}") from None
    check_json(body, limits.max_depth)
    return body


async def _read(request: web.Request, limits: HttpLimits) -> bytes:
    chunks, size = [], 0
    while chunk := await request.content.read(1 << 16):
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise _too_large(size, limits)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limits: HttpLimits) -> BodyError:
    return BodyError(413, f"the body exceeds {limits.max_body_bytes} bytes (got at least {size})")


def check_json(value: Any, max_depth: int = MAX_DEPTH) -> None:
    """:class:`BodyError` (400) when ``value`` nests deeper than ``max_depth`` or holds a
    string (or key) that is not valid Unicode text (a lone surrogate). Iterative: a value
    built in Python may be deeper than the parser's recursion would allow."""
    todo: list[tuple[Any, int]] = [(value, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, str):
            _text(item)
            continue
        if not isinstance(item, list | dict):
            continue
        if depth > max_depth:
            raise BodyError(400, f"the body is nested more than {max_depth} levels deep")
        if isinstance(item, dict):
            for key in item:
                _text(key)
            todo.extend((v, depth + 1) for v in item.values())
        else:
            todo.extend((v, depth + 1) for v in item)


def _text(value: str) -> None:
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = f"{exc.object[exc.start : exc.end]!r}"
        raise BodyError(
            400, f"a string holds {where}, a lone surrogate, which is not Unicode text"
        ) from None


class _Http2Probe(logging.Filter):
    """Drops aiohttp's traceback for a connection that opened with HTTP/2's preface (``PRI *
    HTTP/2.0``): SGLang's model gateway probes every worker that way to tell gRPC from HTTP
    workers, and the answer (a 400, the connection closed) is all it needs."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, BadHttpMessage) and "PRI/Upgrade" in str(exc))


def quiet_http2_probes() -> None:
    """Keep HTTP/2 probes out of the log (idempotent; see :class:`_Http2Probe`)."""
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _Http2Probe) for f in logger.filters):
        logger.addFilter(_Http2Probe())


def bind_socket(host: str, port: int, hint: str) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: any free port) for a server to adopt (aiohttp's
    ``SockSite`` listens on it). Binding first lets a role refuse a taken or foreign address
    before it starts anything; :class:`ConfigError` names the address, the reason and
    ``hint`` (what to change)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = (exc.strerror or str(exc)).lower()
        raise ConfigError(f"cannot listen on {host}:{port}: {why} ({hint})") from exc
    return sock
