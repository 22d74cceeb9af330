"""How a frame's fields are read, shared by the PD frames (:mod:`tspd_core.pd.wire.frames`) and
EPD's (:mod:`tspd_core.epd.wire`), so both planes accept exactly the same spelling of an
integer, a token or a session id. Every function raises :class:`FrameError` saying what was
wrong (with a short, log-safe rendering of the frame).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from tspd_core.pd.errors import FrameError

MAX_SESSION_CHARS = 512

_INT_RE = re.compile(rb"-?(?:0|[1-9][0-9]{0,19})")
_TOKEN_RE = re.compile(rb"[!-~]+")  # printable ASCII, no spaces


def expect_count(frames: Sequence[bytes], lo: int, hi: int, what: str) -> None:
    """:class:`FrameError` unless ``lo <= len(frames) <= hi`` (``what`` names the message)."""
    n = len(frames)
    if not lo <= n <= hi:
        want = str(lo) if lo == hi else f"{lo}..{hi}"
        raise FrameError(f"{what} needs {want} frames, got {n}")


def ascii_int(frame: bytes, what: str, lo: int, hi: int) -> int:
    """An ASCII decimal frame (no padding, ``-`` only if negative) within ``lo..hi``."""
    raw = bytes(frame)
    if not _INT_RE.fullmatch(raw) or raw == b"-0":
        raise FrameError(f"{what} must be an ASCII integer without padding, got {show(raw)}")
    value = int(raw)
    if not lo <= value <= hi:
        raise FrameError(f"{what} {value} is outside {lo}..{hi}")
    return value


def ascii_token(frame: bytes, what: str, limit: int) -> str:
    """A frame of 1..``limit`` printable ASCII characters without spaces, as ``str``."""
    raw = bytes(frame)
    if not 0 < len(raw) <= limit or not _TOKEN_RE.fullmatch(raw):
        raise FrameError(f"{what} must be 1..{limit} printable ASCII chars, got {show(raw)}")
    return raw.decode("ascii")


def ascii_session(frame: bytes, what: str) -> str:
    """A Mooncake session id frame, ``"<ip>:<rpc_port>"``."""
    session = ascii_token(frame, f"{what} session id", MAX_SESSION_CHARS)
    host, sep, port = session.partition(":")
    if not sep or not host:
        raise FrameError(f"{what} session id must be '<ip>:<rpc_port>', got {session!r}")
    ascii_int(port.encode(), f"{what} session id port", 1, 65535)
    return session


def show(raw: bytes, limit: int = 32) -> str:
    """A short, log-safe rendering of an offending frame."""
    raw = bytes(raw)
    head = repr(raw[:limit])
    return head if len(raw) <= limit else f"{head}... ({len(raw)} bytes)"
