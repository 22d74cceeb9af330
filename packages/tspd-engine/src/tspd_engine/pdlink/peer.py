"""What both PD links share: this rank's transfer peer as a link drives it, and the two checks
and settings both halves make the same way.

A link *has* a :class:`PeerTransfers` (composition): the peer, the replica's agreement mesh, the
worker's health and the transfer counters, with the calls every link makes the same way —
poll, abort, stats, close. What differs between the halves (their records, their events)
stays in :mod:`.prefill` and :mod:`.decode`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch.distributed as dist

from tspd_core.ids import RequestId
from tspd_core.layout import CacheContract, encode_contract
from tspd_core.pd import SOLO, GlooMesh, Mesh, PdEvent, PdTunables, PeerError, TransferPeer
from tspd_engine.frames import RequestMode
from tspd_engine.loop.hooks import PdHooks
from tspd_engine.loop.sequence import Sequence
from tspd_engine.model.tp import TpGroup
from tspd_engine.pdlink.config import PdConfig

PeerT = TypeVar("PeerT", bound=TransferPeer)


class PeerTransfers(Generic[PeerT]):
    """One rank's transfer peer as its link uses it (the engine thread only).

    ``broken`` says why the transfer worker is unusable ("" while it works): a dead worker
    raises :class:`PeerError` from the next call, and fails every room at the next poll.
    ``ok`` / ``failed`` count the transfers that ended each way, ``seconds`` sums their time
    (P: hand-over → Succeeded; D: registration → RemotePrefill).
    """

    def __init__(self, peer: PeerT, tp: TpGroup) -> None:
        self.peer = peer
        self.mesh = replica_mesh(tp)
        #: A replica of one rank: no other rank's agreement to wait for.
        self.solo = tp.size == 1
        #: The last poll returned events (its follow-ups may come in the next round).
        self.moved = False
        self.broken = ""
        self.ok = 0
        self.failed = 0
        self.seconds = 0.0

    def poll(self) -> list[PdEvent]:
        """This round's agreed events (a collective: every rank of the replica calls it)."""
        events = self.peer.poll(self.mesh)
        self.moved = bool(events)
        return events

    def flush(self) -> None:
        """Hand the worker the releases deferred to the next call (a dead worker: noted)."""
        try:
            self.peer.flush()
        except PeerError as exc:
            self.broken = str(exc)

    def wake_fds(self) -> list[int]:
        """The worker's notes descriptor while the worker serves (a dead one's reads EOF
        for ever: it would end every wait)."""
        if self.broken or self.peer.worker_lost is not None:
            return []
        return [self.peer.fileno()]

    def abort(self, rid: str, reason: str) -> None:
        """Abort ``rid``'s room; a dead worker is noted, not raised (its rooms fail anyway)."""
        try:
            self.peer.abort(RequestId(rid), reason)
        except PeerError as exc:
            self.broken = str(exc)

    def stats(self) -> dict[str, float]:
        # Engine-side counts only: health checks ask for these every second, and the worker's
        # own counters (TransferPeer.counters) would cost a round trip to it on this thread.
        return {
            "pd_peer_ok": float(not self.broken and self.peer.worker_lost is None),
            "pd_rooms_tracked": float(self.peer.tracked_count()),
            "pd_transfers_ok": float(self.ok),
            "pd_transfers_failed": float(self.failed),
            "pd_transfer_seconds_sum": self.seconds,
        }

    def close(self) -> None:
        self.peer.shutdown()


def half_refusal(seq: Sequence, half: RequestMode, in_use: Callable[[int], bool]) -> str:
    """Why a node serving ``half`` (PREFILL_ONLY or REMOTE_DECODE) refuses ``seq``, or ``""``:
    the other half, a PD half without its room, a room already in use on the node (``in_use``
    says which). A colocated request is nobody's half and is accepted."""
    other = (
        RequestMode.REMOTE_DECODE if half is RequestMode.PREFILL_ONLY else RequestMode.PREFILL_ONLY
    )
    if seq.mode == other:
        node = "prefill" if half is RequestMode.PREFILL_ONLY else "decode"
        return f"this is a {node} node: it does not take {other.name} requests"
    if seq.mode != half:
        return ""
    if seq.pd is None:
        return f"a {half.name} request needs its room and bootstrap address (pd)"
    if in_use(seq.pd.room):
        return f"room {seq.pd.room} is already in use on this node"
    return ""


def replica_mesh(tp: TpGroup) -> Mesh:
    """The agreement mesh of a replica: its TP group is the whole (gloo) world of its ranks,
    so the MIN all-reduce runs over the default group, like the model's collectives (and on
    the same thread, in the same order on every rank)."""
    return SOLO if tp.size == 1 else GlooMesh([dist.group.WORLD])


def peer_kwargs(contract: CacheContract, arena: Any, tp: TpGroup, cfg: PdConfig) -> dict[str, Any]:
    """The keyword arguments both peer configs take, for this rank of the replica."""
    return {
        "contract": encode_contract(contract).decode(),
        "arena": arena,
        "tp_size": tp.size,
        "tp_rank": tp.rank,
        "dp_size": cfg.dp_size,
        "dp_rank": cfg.dp_rank,
        "host": cfg.host,
        "protocol": cfg.protocol,
        "ib_device": cfg.ib_device,
        "tunables": cfg.tunables or PdTunables.from_env(),
        "debug": cfg.debug,
    }


class TransferHooks(PdHooks, Generic[PeerT]):
    """The hooks a prefill and a decode link answer alike, from their :class:`PeerTransfers`:
    news after a round, deferred releases before an idle wait, the worker's note descriptors."""

    transfers: PeerTransfers[PeerT]

    def has_news(self) -> bool:
        return self.transfers.moved

    def on_idle(self) -> None:
        self.transfers.flush()

    def wake_fds(self) -> list[int]:
        return self.transfers.wake_fds()
