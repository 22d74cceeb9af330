"""One ``forkserver`` per launcher, shared with the processes it starts.

``multiprocessing`` gives every process its own forkserver: a process that a forkserver
started and that starts processes of its own (an engine rank starting its transfer worker)
launches a second server, a fresh interpreter that imports torch and the preloaded modules
again (~2 s of CPU on this project's 2-core machine, once per rank). The server that started
the rank has all of that loaded already, and a forkserver serves whoever connects to its
socket: the launcher reads its server's address (:func:`running`) and hands it to the
processes it starts, which point their own ``forkserver`` context at it (:func:`adopt`)::

    launcher ── running(preload) ─► its server (address, pid)
       │  Process(..., server=(address, pid))
       ▼
    rank (a child of that server) ── adopt(server) ─► its workers are forked by the same server

A forkserver's child already holds what a client needs besides the address: the server's
"alive" pipe end and the resource tracker's descriptor (``_serve_one`` installs both), so a
rank that adopted the server keeps it running for as long as it lives, even past its launcher.
What a worker is forked from changes nothing it sees: its arena arrives through the same
pickled reductions, its environment is passed with it (:mod:`.handle`), and its ``parent``
sentinel is the rank's end of the start pipe, as before.

This reaches into ``multiprocessing.forkserver``'s private state (the address, the pid, the
alive descriptor; the same in CPython 3.11 to 3.13). Where that state is not as expected, or
from 3.14 on (its server authenticates clients with a key its children are not given),
:func:`adopt` declines and the process starts its own server, as ``multiprocessing`` would.
If the shared server is gone by the time a worker starts, the process falls back to its own.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver as mpf
import os
import sys
from multiprocessing import resource_tracker
from typing import Any, NamedTuple

log = logging.getLogger(__name__)


class Server(NamedTuple):
    """A running forkserver: where it listens and its process id."""

    address: str
    pid: int


def running(preload: list[str]) -> Server | None:
    """This process's forkserver, started with ``preload`` if it is not running yet (a running
    server keeps the modules it started with); ``None`` where it cannot be shared."""
    if not _shareable():
        return None
    ctx: Any = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload)
    mpf.ensure_running()
    server: Any = mpf._forkserver  # the module keeps no public accessor
    address, pid = server._forkserver_address, server._forkserver_pid
    if not isinstance(address, str) or not isinstance(pid, int):
        return None
    return Server(address, pid)


def adopt(server: Server | None) -> bool:
    """Let this process's ``forkserver`` children come from ``server`` (the one that started
    this process); ``False``, leaving ``multiprocessing`` as it was, where it cannot."""
    state: Any = mpf._forkserver
    if server is None or not _shareable():
        return False
    if state._forkserver_pid is not None or state._forkserver_alive_fd is None:
        return False  # this process runs a server of its own, or no server started it
    fallback = type(state).ensure_running.__get__(state)

    def ensure_running() -> None:
        # The server is not this process's child: it is alive while its process exists.
        if state._forkserver_address == server.address and _exists(server.pid):
            resource_tracker.ensure_running()
            return
        if state._forkserver_address == server.address:
            log.warning("shared forkserver %d is gone; this process starts its own", server.pid)
            state._forkserver_address = None
            del state.ensure_running
        fallback()

    state._forkserver_address = server.address
    state.ensure_running = ensure_running
    return True


def _shareable() -> bool:
    if sys.version_info >= (3, 14) or sys.platform != "linux":
        return False
    state = getattr(mpf, "_forkserver", None)
    return all(
        hasattr(state, name)
        for name in ("_forkserver_address", "_forkserver_pid", "_forkserver_alive_fd")
    )


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
