"""Messages between an engine-side peer and its transfer worker process, and their codec.

They travel over a local pipe, never the network, but still without pickle: a message is a
one-byte tag, a length-prefixed compact JSON header of scalars, and zero or more raw int64
arrays (block tables), so a 4,096-token plan costs one small memcpy, not an object graph.

    engine -> worker   TrackRoom, SubmitChunk / ArmChunk / BootstrapToken (P),
                       PublishManifest (D), AbortRoom,
                       ReleaseRoom, Shutdown; calls: StatsRequest, MetricsRequest,
                       ReleaseArena, RestoreArena
    worker -> engine   WorkerReady | WorkerFatal (once, at start), RoomUpdate (any number);
                       one answer per call, with the call's ``seq``: WorkerCounters,
                       WorkerMetrics, Reply

Ordering: the pipe is FIFO, so a worker sees a room's TrackRoom before anything else about it,
and the engine sees a room's updates in the order the worker decided them. Answers carry the
call's ``seq``, so any thread that drains the notes pipe can route them to their caller.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from tspd_core.ids import Room
from tspd_core.pd.errors import FrameError
from tspd_core.pd.status import TransferPoll

_HEAD = struct.Struct("<BII")  # tag, header length, array count
_ARRAY = struct.Struct("<Q")  # element count of one int64 array


class Tag(IntEnum):
    TRACK = 1
    SUBMIT = 2
    PUBLISH = 3
    RELEASE = 4
    SHUTDOWN = 5
    STATS = 6
    ABORT = 7
    METRICS = 8
    RELEASE_ARENA = 9
    RESTORE_ARENA = 10
    ARM = 11
    TOKEN = 12
    READY = 16
    FATAL = 17
    UPDATE = 18
    COUNTERS = 19
    METRICS_DATA = 20
    REPLY = 21


@dataclass(frozen=True, slots=True)
class TrackRoom:
    """Start tracking a room (the engine admitted its request); P: Bootstrapping from now."""

    TAG: ClassVar[Tag] = Tag.TRACK
    room: Room
    bootstrap_host: str
    bootstrap_port: int


@dataclass(frozen=True, slots=True, eq=False)
class SubmitChunk:
    """P: the forward for tokens ``[start, end)`` finished; send what it completed.

    ``block_ids`` holds P's block table of the request per group (group_specs order), at least
    up to ``end``. The final chunk carries the first token and what D reports with it.
    """

    TAG: ClassVar[Tag] = Tag.SUBMIT
    room: Room
    start: int
    end: int
    final: bool
    block_ids: tuple[npt.NDArray[np.int64], ...]
    token: int = -1
    spec_ids: tuple[int, ...] = ()
    cached_tokens: int = 0
    logprob: float | None = None


@dataclass(frozen=True, slots=True, eq=False)
class ArmChunk:
    """P, layerwise: the forward for tokens ``[start, end)`` is about to run; send its KV one
    interval at a time as the step counter passes ``begin`` + each interval's last step.

    A final chunk's Success waits for its :class:`BootstrapToken` (after the forward).
    """

    TAG: ClassVar[Tag] = Tag.ARM
    room: Room
    start: int
    end: int
    final: bool
    block_ids: tuple[npt.NDArray[np.int64], ...]
    begin: int  #: the step counter's value before this forward (mod 2**62)


@dataclass(frozen=True, slots=True)
class BootstrapToken:
    """P, layerwise: the first token (and what goes with Success) of a room whose final chunk
    was armed; the worker sends Success once every interval of it is written."""

    TAG: ClassVar[Tag] = Tag.TOKEN
    room: Room
    token: int
    spec_ids: tuple[int, ...] = ()
    cached_tokens: int = 0
    logprob: float | None = None


@dataclass(frozen=True, slots=True)
class PublishManifest:
    """D: the room's pages are allocated and zeroed; publish this manifest (JSON) to P —
    at once if the room is Bootstrapped, else as soon as its look-up finished (a D replica
    of one rank hands its manifest over with the registration, see docs/pd.md)."""

    TAG: ClassVar[Tag] = Tag.PUBLISH
    room: Room
    manifest: str


@dataclass(frozen=True, slots=True)
class ReleaseRoom:
    """Forget a room; the replica agreed on its final event (or the engine never tracked it).

    ``failed``: the replica failed the room, and every rank's writes of it have drained; P
    pushes Failed to every D session that pre-allocated it (even after a local Success), or,
    for a room it does not know, remembers it so a later pre-allocation is refused at once.
    """

    TAG: ClassVar[Tag] = Tag.RELEASE
    room: Room
    reason: str = ""
    failed: bool = False


@dataclass(frozen=True, slots=True)
class AbortRoom:
    """Give up a room the engine still tracks; the worker reports it Failed (with ``reason``)
    once no write of it can still land, and forgets it on the following ReleaseRoom."""

    TAG: ClassVar[Tag] = Tag.ABORT
    room: Room
    reason: str
    cause: str = "abort"  #: a FailureCause value (the replica's own aborts say "replica")


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Stop the worker: close sockets, unregister memory, exit."""

    TAG: ClassVar[Tag] = Tag.SHUTDOWN


@dataclass(frozen=True, slots=True)
class StatsRequest:
    """Ask the worker for its counters (answered with one WorkerCounters)."""

    TAG: ClassVar[Tag] = Tag.STATS
    seq: int = 0


@dataclass(frozen=True, slots=True)
class WorkerCounters:
    """The worker's cumulative counters (bytes written, jobs, staged jobs, scatters, ...)."""

    TAG: ClassVar[Tag] = Tag.COUNTERS
    values: dict[str, float]
    seq: int = 0


@dataclass(frozen=True, slots=True)
class MetricsRequest:
    """Ask the worker for a metrics snapshot (answered with one WorkerMetrics)."""

    TAG: ClassVar[Tag] = Tag.METRICS
    seq: int = 0


@dataclass(frozen=True, slots=True)
class WorkerMetrics:
    """The worker's metrics (``tspd_core.pd.metrics.registry.MetricsSnapshot.families``)."""

    TAG: ClassVar[Tag] = Tag.METRICS_DATA
    families: dict[str, Any]
    seq: int = 0


@dataclass(frozen=True, slots=True)
class ReleaseArena:
    """Sleep: unregister the arena from Mooncake, refused while a write of it may run."""

    TAG: ClassVar[Tag] = Tag.RELEASE_ARENA
    seq: int = 0


@dataclass(frozen=True, slots=True)
class RestoreArena:
    """Wake: register the arena again (P: same session; D: a fresh session)."""

    TAG: ClassVar[Tag] = Tag.RESTORE_ARENA
    seq: int = 0


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to a ReleaseArena / RestoreArena call."""

    TAG: ClassVar[Tag] = Tag.REPLY
    seq: int
    ok: bool
    reason: str = ""
    session_id: str = ""  #: the worker's Mooncake session after the call


@dataclass(frozen=True, slots=True)
class WorkerReady:
    """The worker is serving: its PULL port, Mooncake session and view of the arena."""

    TAG: ClassVar[Tag] = Tag.READY
    host: str
    port: int
    session_id: str
    base_ptr: int


@dataclass(frozen=True, slots=True)
class WorkerFatal:
    """The worker could not start (or stopped serving); ``reason`` is for the operator."""

    TAG: ClassVar[Tag] = Tag.FATAL
    reason: str


@dataclass(frozen=True, slots=True)
class RoomUpdate:
    """A room's state moved (forward only). Success on D carries what P sent with it."""

    TAG: ClassVar[Tag] = Tag.UPDATE
    room: Room
    status: TransferPoll
    token: int = -1
    spec_ids: tuple[int, ...] = ()
    cached_tokens: int = 0
    logprob: float | None = None
    reason: str = ""
    #: Failed only: no write of the room can land on (D) or read from (P) this rank any more.
    quiet: bool = False
    #: D, Failed only: a P rank pushed Failed, so no P rank of the room writes any more.
    settled: bool = False
    cause: str = ""  #: Failed only: a :class:`~tspd_core.pd.status.FailureCause` value


Message = (
    TrackRoom
    | SubmitChunk
    | ArmChunk
    | BootstrapToken
    | PublishManifest
    | ReleaseRoom
    | AbortRoom
    | Shutdown
    | StatsRequest
    | WorkerCounters
    | MetricsRequest
    | WorkerMetrics
    | ReleaseArena
    | RestoreArena
    | Reply
    | WorkerReady
    | WorkerFatal
    | RoomUpdate
)
#: Answers to calls: routed by ``seq`` to the thread waiting for them.
Answer = WorkerCounters | WorkerMetrics | Reply
_BY_TAG: dict[int, type[Any]] = {
    cls.TAG: cls
    for cls in (
        TrackRoom,
        SubmitChunk,
        ArmChunk,
        BootstrapToken,
        PublishManifest,
        ReleaseRoom,
        AbortRoom,
        Shutdown,
        StatsRequest,
        WorkerCounters,
        MetricsRequest,
        WorkerMetrics,
        ReleaseArena,
        RestoreArena,
        Reply,
        WorkerReady,
        WorkerFatal,
        RoomUpdate,
    )
}


def encode(msg: Message) -> bytes:
    """One message as bytes: tag, JSON header of its scalar fields, then its int64 arrays."""
    header: dict[str, Any] = {}
    arrays: list[npt.NDArray[np.int64]] = []
    for f in fields(msg):
        value = getattr(msg, f.name)
        if f.name == "block_ids":
            arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in value]
        else:
            header[f.name] = list(value) if isinstance(value, tuple) else value
    head = json.dumps(header, separators=(",", ":")).encode()
    parts = [_HEAD.pack(msg.TAG, len(head), len(arrays)), head]
    for arr in arrays:
        parts += [_ARRAY.pack(arr.size), arr.tobytes()]
    return b"".join(parts)


def decode(buf: bytes) -> Message:
    """Inverse of :func:`encode`; :class:`FrameError` on anything that does not fit."""
    try:
        tag, head_len, count = _HEAD.unpack_from(buf, 0)
        cls = _BY_TAG[tag]
        pos = _HEAD.size + head_len
        header = json.loads(buf[_HEAD.size : pos])
        arrays = []
        for _ in range(count):
            (n,) = _ARRAY.unpack_from(buf, pos)
            pos += _ARRAY.size
            arrays.append(np.frombuffer(buf, dtype=np.int64, count=n, offset=pos).copy())
            pos += 8 * n
        if pos != len(buf):
            raise ValueError(f"{len(buf) - pos} trailing bytes")
        if cls is SubmitChunk or cls is ArmChunk:
            header["block_ids"] = tuple(arrays)
        for key in ("spec_ids",):
            if key in header:
                header[key] = tuple(header[key])
        if "status" in header:
            header["status"] = TransferPoll(header["status"])
        return cls(**header)  # type: ignore[no-any-return]
    except (KeyError, ValueError, TypeError, struct.error, RecursionError) as exc:
        raise FrameError(f"bad engine/worker message ({len(buf)} bytes): {exc!r}"[:300]) from exc
