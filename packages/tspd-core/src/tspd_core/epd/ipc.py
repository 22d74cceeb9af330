"""Messages between an encode rank's engine process and its transfer worker, and their codec.

They travel over a local pipe: a one-byte tag and a compact JSON object of scalar fields, no
pickle. The pipe is FIFO, so the worker sees a room's chunk before an abort sent after it, and
the engine sees a room's verdict once, after the worker stopped reading its rows.

    engine -> worker   SubmitChunk, AbortRoom, Sync, Shutdown
    worker -> engine   WorkerReady | WorkerFatal (once, at start), ChunkDone (one per chunk),
                       Synced (one per Sync, after every command sent before it was handled)

WorkerReady and WorkerFatal are PD's own (:mod:`tspd_core.pd.wire.ipc`, same tags 16 and 17 in both
codecs): the shared worker plumbing (:mod:`tspd_core.pd.proc.handle`, :mod:`tspd_core.pd.proc.loop`)
sends and awaits them for either kind.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import IntEnum
from typing import Any, ClassVar

from tspd_core.ids import Room
from tspd_core.pd.errors import FrameError
from tspd_core.pd.status import TransferPoll
from tspd_core.pd.wire.ipc import WorkerFatal as WorkerFatal
from tspd_core.pd.wire.ipc import WorkerReady as WorkerReady


class Tag(IntEnum):
    SUBMIT = 1
    ABORT = 2
    SHUTDOWN = 3
    SYNC = 4
    READY = 16  # taken by PD's WorkerReady (its TAG), shared by both codecs
    FATAL = 17  # taken by PD's WorkerFatal
    DONE = 18
    SYNCED = 19


@dataclass(frozen=True, slots=True)
class SubmitChunk:
    """An item's rows sit in the send buffer at these offsets: send them to its receivers."""

    TAG: ClassVar[Tag] = Tag.SUBMIT
    room: Room
    offset: int
    n_tokens: int
    hidden: int
    dtype: str
    nbytes: int
    deepstack_offset: int = 0
    deepstack_nbytes: int = 0


@dataclass(frozen=True, slots=True)
class AbortRoom:
    """Give up on a room: its receivers get Failed now (and any that register later)."""

    TAG: ClassVar[Tag] = Tag.ABORT
    room: Room
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the worker: let running writes finish, close sockets, unregister, exit."""

    TAG: ClassVar[Tag] = Tag.SHUTDOWN


@dataclass(frozen=True, slots=True)
class Sync:
    """Answer with :class:`Synced` once every command sent before this one was handled."""

    TAG: ClassVar[Tag] = Tag.SYNC
    token: int


@dataclass(frozen=True, slots=True)
class Synced:
    """The worker handled every command the engine sent before ``Sync(token)``."""

    TAG: ClassVar[Tag] = Tag.SYNCED
    token: int


@dataclass(frozen=True, slots=True)
class ChunkDone:
    """A submitted chunk's verdict. The worker no longer reads its rows: free them."""

    TAG: ClassVar[Tag] = Tag.DONE
    room: Room
    status: TransferPoll  #: SUCCESS: every receiver has its rows; FAILED: see reason
    reason: str = ""
    parked: bool = False  #: the chunk waited for receivers to register
    receivers: int = 0  #: prefill ranks served (or told Failed)
    nbytes: int = 0  #: bytes written over Mooncake for this chunk


Message = SubmitChunk | AbortRoom | Sync | Shutdown | WorkerReady | WorkerFatal | ChunkDone | Synced
_BY_TAG: dict[int, type[Any]] = {
    cls.TAG: cls
    for cls in (SubmitChunk, AbortRoom, Sync, Shutdown, WorkerReady, WorkerFatal, ChunkDone, Synced)
}


def encode(msg: Message) -> bytes:
    """Tag byte, then the fields as compact JSON."""
    return bytes([msg.TAG]) + json.dumps(asdict(msg), separators=(",", ":")).encode()


def decode(buf: bytes) -> Message:
    """Inverse of :func:`encode`; :class:`FrameError` on anything that does not fit."""
    try:
        cls = _BY_TAG[buf[0]]
        fields = json.loads(buf[1:])
        if "status" in fields:
            fields["status"] = TransferPoll(fields["status"])
        msg: Message = cls(**fields)
        return msg
    except (IndexError, KeyError, ValueError, TypeError) as exc:
        raise FrameError(f"bad encode engine/worker message ({len(buf)} bytes): {exc}") from exc
