"""P's bookkeeping inside the transfer worker: registered D sessions and rooms.

All of it is owned by the worker's control thread (no locks). The checks a pre-allocation must
pass (wire.md §2.2) live here as plain functions over these records, so they read as the list in
the spec does and can be tested without sockets.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from tspd_core.ids import Room
from tspd_core.layout import (
    BlockManifest,
    CacheContract,
    build_manifest,
    parse_manifest,
    slot_range,
    validate_manifest,
)
from tspd_core.layout.routes import RoutePlan
from tspd_core.pd.errors import FrameError
from tspd_core.pd.status import TransferPoll
from tspd_core.pd.wire import ipc
from tspd_core.pd.wire.frames import PreAllocation, Registration


@dataclass(frozen=True, slots=True)
class DSession:
    """One accepted registration: a D rank, its arena and the route to its replica."""

    reg: Registration
    contract: CacheContract
    route: RoutePlan
    dummy: bool  #: this P rank serves no D rank of that replica (it only rendezvouses)


@dataclass(slots=True)
class Destination:
    """One pre-allocation of a room: who, and (unless a dummy) where the pages go."""

    session: DSession
    manifest: BlockManifest | None


@dataclass(slots=True)
class PRoom:
    """One room on this P rank, from its first sign (TrackRoom or a pre-allocation) to release.

    The worker's one record of the room (its control thread's). The engine's record of the
    same request is the peer's ``Tracked``, across the process boundary: the two meet only
    through the IPC frames (TrackRoom, chunks, first tokens, aborts and releases in;
    RoomUpdate out), so each holds what its process acts on and nothing it could derive.
    """

    room: Room
    created: float
    #: When the engine registered the request (TrackRoom; register -> Success latency); None
    #: while the engine does not track the room: not yet (pre-allocations only), or no more.
    tracked_at: float | None = None
    ready: bool = False  #: every planned pre-allocation arrived and passed the checks
    status: TransferPoll = TransferPoll.BOOTSTRAPPING
    dests: dict[str, Destination] = field(default_factory=dict)
    chunks: int = 0  #: chunks submitted so far (the first one also covers P's prefix hit)
    pending: int = 0  #: write jobs queued or running
    #: The final chunk: a SubmitChunk carries the first token; an ArmChunk (layerwise) waits
    #: for its BootstrapToken, which turns it into a SubmitChunk.
    final: ipc.SubmitChunk | ipc.ArmChunk | None = None
    #: When the final chunk reached this worker (the forward was done): the hand-over runs
    #: from here to Success sent (``handover_seconds``).
    final_in: float | None = None
    #: Chunks handed over (or armed, layerwise) before the room was Bootstrapped (the
    #: forward ran before D's pre-allocations arrived): planned, and written in order, the
    #: moment it is.
    held: list[ipc.SubmitChunk | ipc.ArmChunk] = field(default_factory=list)
    #: The first token of a held armed final chunk (its forward ended before Bootstrapped).
    held_token: ipc.BootstrapToken | None = None
    reason: str = ""
    cause: str = ""  #: a FailureCause value, once Failed
    notified: tuple[TransferPoll, bool] | None = None  #: last (state, quiet) told the engine
    #: Bootstrapped was told to the engine: the replica may have agreed on it, so other P
    #: ranks may be writing; Failed pushes then wait for the replica's release.
    exposed: bool = False
    released: bool = False  #: the engine released it as failed: push Failed once drained
    pushed: set[str] = field(default_factory=set)  #: sessions that got the Failed push
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def tracked(self) -> bool:
        """The engine tracks the room (its request is registered and not released)."""
        return self.tracked_at is not None

    @property
    def is_dummy(self) -> bool:
        return bool(self.dests) and all(d.session.dummy for d in self.dests.values())

    @property
    def rpc_port_sum(self) -> int:
        """wire.md §8: a room's transfer queue is its sessions' RPC ports summed, mod queues."""
        return sum(d.session.reg.rpc_port for d in self.dests.values())


@dataclass(frozen=True, slots=True)
class Tombstone:
    """A room the engine released (or aborted before this rank knew it)."""

    since: float
    #: Set when the room was aborted: a later TrackRoom of it fails at once with this reason.
    abort_reason: str | None = None


def check_pre_allocation(
    room: PRoom, pa: PreAllocation, session: DSession, p_rank: int
) -> Destination:
    """wire.md §2.2's per-message checks; :class:`FrameError` says which one failed."""
    if pa.is_dummy != session.dummy:
        want = "an empty (dummy)" if session.dummy else "a real"
        raise FrameError(f"room {pa.room}: session {pa.session_id} must send {want} manifest")
    if pa.session_id in room.dests:
        raise FrameError(f"room {pa.room}: second pre-allocation from {pa.session_id}")
    manifest = None
    if not pa.is_dummy:
        try:
            manifest = parse_manifest(pa.manifest)
            validate_manifest(manifest, session.contract)
        except ValueError as exc:
            raise FrameError(f"room {pa.room}: bad manifest from {pa.session_id}: {exc}") from exc
    fanout = session.route.preallocation_fanout(p_rank)
    if len(room.dests) + 1 > fanout:
        raise FrameError(f"room {pa.room}: more than {fanout} pre-allocations")
    return Destination(session, manifest)


def check_complete(room: PRoom, p_rank: int) -> bool:
    """True once the fan-out is reached and consistent (same D replica, exact rank set)."""
    first = next(iter(room.dests.values())).session
    if len(room.dests) < first.route.preallocation_fanout(p_rank):
        return False
    sizes = {d.session.reg.tp_size for d in room.dests.values()}
    ranks = sorted(d.session.reg.tp_rank for d in room.dests.values())
    expected = [0] if first.dummy else list(first.route.destinations(p_rank))
    if len(sizes) != 1 or ranks != expected:
        raise FrameError(
            f"room {room.room}: pre-allocations came from D ranks {ranks} (TP sizes "
            f"{sorted(sizes)}) but this P rank serves D ranks {expected}"
        )
    windows = {
        (d.manifest.prefix_len, d.manifest.prompt_len) for d in room.dests.values() if d.manifest
    }
    if len(windows) > 1:
        raise FrameError(f"room {room.room}: D ranks disagree on (prefix, prompt): {windows}")
    return True


def source_manifest(
    contract: CacheContract, tables: tuple[npt.NDArray[np.int64], ...], dst: BlockManifest
) -> BlockManifest:
    """P's manifest for D's window, from P's block table rows (group_specs order).

    A non-final chunk may come before P allocated (or wrote) its table past the chunk: slots
    the table does not cover yet are filled with distinct unused page ids, which only satisfy
    validation — the chunk's positions never reach them, so no descriptor reads them.
    """
    gids = contract.group_ids()
    if len(tables) != len(gids):
        raise FrameError(f"block tables for {len(tables)} groups, contract has {len(gids)}")
    rows = {}
    for spec, row in zip(contract.group_specs, tables, strict=True):
        stop = slot_range(spec, dst.prefix_len, dst.prompt_len).stop
        rows[spec.group_id] = _pad(row, stop, contract.group(spec.group_id).page_count)
    try:
        return build_manifest(contract, rows, dst.prefix_len, dst.prompt_len)
    except ValueError as exc:
        raise FrameError(f"P block table does not fit D's window: {exc}") from exc


def _pad(row: npt.NDArray[np.int64], stop: int, page_count: int) -> npt.NDArray[np.int64]:
    if row.size >= stop and (stop == 0 or row[:stop].all()):
        return row
    out = np.zeros(max(stop, row.size), dtype=np.int64)
    out[: row.size] = row
    holes = np.flatnonzero(out[:stop] == 0)
    free = np.setdiff1d(np.arange(1, page_count, dtype=np.int64), out, assume_unique=False)
    out[holes] = free[: holes.size]
    return out
