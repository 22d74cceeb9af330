"""Latency stamps across processes: where one request's time goes (off unless switched on).

With ``TSPD_TRACE=<directory>`` in a process's environment (or after :func:`enable`), every
stamp appends one line to ``<directory>/<pid>.tsv`` — the router, the nodes, their rank
processes and transfer workers each write their own file, and children inherit the
variable::

    <CLOCK_MONOTONIC ns> TAB <process label> TAB <thread> TAB <key> TAB <what> TAB <extra>

CLOCK_MONOTONIC is one clock for every process of a host, so stamps of different processes
line up (``time.perf_counter`` reads the same clock on Linux). A request is keyed by its
request id (router, nodes, engines) and its room by ``room:<room>`` (transfer workers, which
never see request ids); the engine-side peer writes one ``<role>.register`` stamp per
request with the request id as ``extra``, which joins the two. A process names its part of a
deployment once (:func:`label`: ``router``, ``decode-node``, ``prefill-rank0``,
``decode-worker0`` ...), so the same step on two nodes stays apart. ``benchmarks/breakdown.py``
turns the stamps into per-stage medians (``--breakdown`` of the transfer and end-to-end
benchmarks).

Each stamp is one ``write`` on a file opened with ``O_APPEND`` (a few µs, nothing buffered,
so a killed process loses nothing). Off, a stamp costs a function call and one test. For
measurements, not for production: the files grow by ~60 bytes a stamp.

Threading: any thread; each line is a single write.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

#: The environment variable naming the directory stamps go to (unset or empty: off).
ENV = "TSPD_TRACE"

_fd: int | None = None
_lock = threading.Lock()
_label = ""
#: Tabs and line breaks in a key or extra (a client's request id) would break the line format.
_CLEAN = str.maketrans("\t\r\n", "   ")


@dataclass(frozen=True, slots=True)
class Stamp:
    """One line of a trace file."""

    t_ns: int  #: CLOCK_MONOTONIC nanoseconds
    pid: int
    label: str  #: the process's part (see :func:`label`), "" if it never named one
    thread: str
    key: str  #: a request id, or ``room:<room>``
    what: str  #: the step, ``<part>.<event>`` (e.g. ``dw.prealloc_sent``)
    extra: str = ""


def enabled() -> bool:
    """Whether stamps of this process are written."""
    return _fd is not None


def label(name: str) -> None:
    """Name this process's part of the deployment in its stamps (e.g. ``decode-rank0``)."""
    global _label
    _label = name.translate(_CLEAN)


def mark(key: str, what: str, extra: str = "") -> None:
    """Stamp ``what`` for ``key`` (a request id) now; a no-op unless tracing is on."""
    if _fd is None:
        return
    _write(key, what, extra)


def mark_room(room: int, what: str, extra: str = "") -> None:
    """Stamp ``what`` for a room (the key ``room:<room>``); a no-op unless tracing is on."""
    if _fd is None:
        return
    _write(f"room:{room}", what, extra)


def _write(key: str, what: str, extra: str) -> None:
    now = time.monotonic_ns()
    thread = threading.current_thread().name
    key, extra = key.translate(_CLEAN), extra.translate(_CLEAN)
    line = f"{now}\t{_label}\t{thread}\t{key}\t{what}\t{extra}\n"
    fd = _fd
    if fd is None:
        return
    try:
        os.write(fd, line.encode("utf-8", "replace"))
    except OSError:  # the directory went away: stop tracing rather than fail the caller
        _close()


def enable(directory: str | os.PathLike[str]) -> Path:
    """Turn stamps on for this process and, through :data:`ENV`, for the processes it starts
    from now on; returns the directory (created if missing)."""
    path = Path(directory).resolve()
    path.mkdir(parents=True, exist_ok=True)
    os.environ[ENV] = str(path)
    _open(str(path))
    return path


def disable() -> None:
    """Turn stamps off for this process and for the processes it starts from now on."""
    os.environ.pop(ENV, None)
    _close()


def read(directory: str | os.PathLike[str]) -> list[Stamp]:
    """Every stamp under ``directory``, oldest first (a malformed line is skipped)."""
    out: list[Stamp] = []
    for path in sorted(Path(directory).glob("*.tsv")):
        pid = int(path.stem) if path.stem.isdigit() else 0
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            parts = line.split("\t")
            if len(parts) != 6 or not parts[0].isdigit():
                continue
            out.append(Stamp(int(parts[0]), pid, *parts[1:]))
    out.sort(key=lambda s: s.t_ns)
    return out


def _open(directory: str) -> None:
    global _fd
    with _lock:
        if _fd is not None:
            os.close(_fd)
            _fd = None
        path = os.path.join(directory, f"{os.getpid()}.tsv")
        try:
            _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            _fd = None


def _close() -> None:
    global _fd
    with _lock:
        fd, _fd = _fd, None
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


def _from_env() -> None:
    directory = os.environ.get(ENV, "")
    if directory:
        _open(directory)
    else:
        _close()


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork
    _from_env()


# A forked child writes its own file (fork start method, forked servers).
os.register_at_fork(after_in_child=_after_fork)
_from_env()
