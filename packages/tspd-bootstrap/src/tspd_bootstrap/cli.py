"""``tspd-bootstrap`` (also ``python -m tspd_bootstrap``): run a standalone bootstrap server.

Prints one readiness line on stdout once bound (``tspd-bootstrap: serving kv bootstrap on
http://HOST:PORT (pid N)``, with the real port when ``--port 0``), serves until SIGINT or
SIGTERM, then stops cleanly and exits 0. A bind failure exits 1 with the reason on stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

from tspd_bootstrap.auth import MIN_TOKEN_BYTES, TOKEN_ENV, TOKEN_FILE_ENV, ClusterCredential
from tspd_bootstrap.errors import BootstrapError
from tspd_bootstrap.layout import DEFAULT_CANONICALIZER, load_canonicalizer
from tspd_bootstrap.registry import DEFAULT_LEASE_S
from tspd_bootstrap.server import (
    BIND_TIMEOUT_S,
    BODY_TIMEOUT_S,
    DEFAULT_PORT,
    HEADER_TIMEOUT_S,
    BootstrapServer,
)
from tspd_bootstrap.version import __version__

log = logging.getLogger("tspd_bootstrap.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tspd-bootstrap",
        description="Bootstrap HTTP server: the rendezvous through which decode ranks find "
        "prefill ranks (and prefill ranks find encode ranks, with --embedding).",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind: the address decode and prefill ranks reach this host at "
        "(default: 127.0.0.1, this host only)",
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT}; 0 = any)"
    )
    parser.add_argument(
        "--embedding",
        action="store_true",
        help="serve EPD encode ranks (no cache_layout) instead of PD prefill ranks",
    )
    parser.add_argument(
        "--layout-canonicalizer",
        metavar="MODULE:FUNCTION",
        help="callable(str) -> str that validates and canonicalises cache layouts "
        f"(default: {DEFAULT_CANONICALIZER}, the strict contract form every tspd server uses)",
    )
    parser.add_argument(
        "--lease",
        type=float,
        default=DEFAULT_LEASE_S,
        metavar="S",
        help="seconds a renewing (tspd) rank holds its address after its last registration; "
        "until then a registration of its engine rank from another address is refused (409) "
        f"unless sealed with the cluster credential (default: {DEFAULT_LEASE_S:g})",
    )
    add_credential_args(parser)
    admin = parser.add_mutually_exclusive_group()
    admin.add_argument(
        "--admin",
        action="store_true",
        help="serve the operator DELETE /ranks endpoints (off by default: they answer 403, "
        "since anyone who reaches --host could forget the deployment's ranks)",
    )
    # Before --admin existed the endpoints were on by default and --no-admin turned them off;
    # it is still accepted (and is now the default) so that older command lines keep working.
    admin.add_argument("--no-admin", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--bind-timeout",
        type=float,
        default=BIND_TIMEOUT_S,
        help=f"seconds to wait for the bind (default: {BIND_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_TIMEOUT_S,
        help="seconds a client may take to send a request's headers, or stay idle between "
        f"requests (default: {HEADER_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT_S,
        help=f"seconds a PUT /route body may take to arrive (default: {BODY_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level (default: info)",
    )
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


CREDENTIAL_HELP = (
    "the cluster credential: every registration and look-up at the bootstrap server, and "
    "every registration of a decode rank with a prefill rank, must carry its HMAC seal (off: "
    "anyone who reaches the ports may register; docs/bootstrap.md, 'The cluster credential')"
)


def add_credential_args(parser: argparse.ArgumentParser) -> None:
    """``--cluster-token`` / ``--cluster-token-file`` (also the launcher's, for its roles)."""
    g = parser.add_argument_group("cluster credential", CREDENTIAL_HELP)
    one = g.add_mutually_exclusive_group()
    one.add_argument(
        "--cluster-token-file",
        metavar="PATH",
        help=f"a file holding the secret (its first line, {MIN_TOKEN_BYTES} bytes or more; "
        f"default: ${TOKEN_FILE_ENV}, else ${TOKEN_ENV} holds the secret itself)",
    )
    one.add_argument(
        "--cluster-token",
        metavar="TOKEN",
        help="the secret itself (shown by ps: prefer the file or the environment)",
    )


def credential_from_args(args: argparse.Namespace) -> ClusterCredential | None:
    """The credential the flags or the environment give (None: off); ValueError if unusable."""
    return ClusterCredential.resolve(args.cluster_token, args.cluster_token_file)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        canonicalizer = (
            load_canonicalizer(args.layout_canonicalizer) if args.layout_canonicalizer else None
        )
        credential = credential_from_args(args)
        if args.lease <= 0:
            raise ValueError(f"--lease must be > 0 s, got {args.lease:g}")
        server = BootstrapServer(
            args.host,
            args.port,
            embedding=args.embedding,
            layout_canonicalizer=canonicalizer,
            credential=credential,
            lease_s=args.lease,
            bind_timeout=args.bind_timeout,
            allow_admin=args.admin,
            access_log=args.access_log,
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
        )
    except ValueError as exc:
        print(f"tspd-bootstrap: {exc}", file=sys.stderr)
        return 2
    if credential is not None:
        log.info("cluster credential on (fingerprint %s)", credential.fingerprint)
    return _serve(server, args.host)


def _serve(server: BootstrapServer, host: str) -> int:
    stop = threading.Event()
    previous = _install_signals(lambda _signum, _frame: stop.set())
    try:
        server.start()
    except BootstrapError as exc:
        print(f"tspd-bootstrap: {exc}", file=sys.stderr)
        _restore_signals(previous)
        return 1
    shown = f"[{host}]" if ":" in host else host
    print(
        f"tspd-bootstrap: serving {server.kind.value} bootstrap on "
        f"http://{shown}:{server.port} (pid {os.getpid()})",
        flush=True,
    )
    try:
        while not stop.wait(0.5):
            pass
    finally:
        log.info("stopping bootstrap server on port %d", server.port)
        server.close()
        _restore_signals(previous)
    log.info("bootstrap server stopped")
    return 0


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _install_signals(handler: Callable[[int, FrameType | None], None]) -> dict[int, object]:
    """Route SIGINT/SIGTERM to ``handler`` (main thread only); return what they replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    before: dict[int, object] = {int(s): signal.getsignal(s) for s in _SIGNALS}
    for signum in _SIGNALS:
        signal.signal(signum, handler)
    return before


def _restore_signals(before: dict[int, object]) -> None:
    for signum, handler in before.items():
        # getsignal() answers None for a handler not installed from Python: fall back to default.
        restored = handler if callable(handler) or isinstance(handler, int) else signal.SIG_DFL
        signal.signal(signum, restored)
