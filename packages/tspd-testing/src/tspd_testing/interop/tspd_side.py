"""tspd's half of an interop pairing: real peers (their transfer worker processes, Mooncake,
ZMQ), the bootstrap server a tspd P instance hosts, identity-tagged arenas and the oracle.

Driving is what an engine's scheduler does: register each room, publish D's manifest (or hand
P's block tables and first token over) once the room is bootstrapped, poll until it ends.
:func:`drive_many` drives several instances in one loop (a tspd P and a tspd D) and stamps each
room's steps (:class:`Stamps`), as the TokenSpeed host does for its side.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection as mpc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tspd_bootstrap import BootstrapServer
from tspd_core.ids import RequestId, Room
from tspd_core.layout import CacheContract, build_manifest, encode_contract, slot_range
from tspd_core.pd import (
    BootstrapInfo,
    Bootstrapped,
    DecodePeer,
    DecodePeerConfig,
    Failed,
    PdEvent,
    PdTunables,
    PrefillPeer,
    PrefillPeerConfig,
    RemotePrefill,
    Succeeded,
)
from tspd_core.pd.decode.peer import DecodeOutbox, RemotePrefillRow
from tspd_core.pd.prefill.peer import FirstToken, PrefillOutbox, RemoteDecodeRow
from tspd_testing.identity import RankView, check_identity, fill_identity, page_mask

LOOPBACK = "127.0.0.1"
Table = dict[str, npt.NDArray[np.int64]]


class ErrorLog(logging.Handler):
    """Every record of ERROR or above in this process (tspd's workers log through it too)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


@dataclass(frozen=True, slots=True)
class Room_:
    """One request on both sides: its room, lengths, block tables and first token."""

    room: int
    prompt_len: int
    prefix_len: int
    p_table: Table
    d_table: Table
    token: int

    @property
    def rid(self) -> RequestId:
        return RequestId(f"room-{self.room}")


def shared_arena(contract: CacheContract) -> torch.Tensor:
    arena = torch.zeros(contract.plan.arena_bytes, dtype=torch.uint8)
    arena.share_memory_()  # type: ignore[no-untyped-call]
    return arena


#: (room, step) -> one perf_counter stamp per rank of one instance: "registered", "handed"
#: (P: its hand-over; D: its manifest published), "done" (its final event seen).
Stamps = dict[tuple[int, str], list[float]]


@dataclass
class TspdInstance:
    """Ranks of one tspd P instance or D replica (and the P instance's bootstrap server):
    all of them, or some (a rank hosted in a child process, :mod:`~.tspd_host`)."""

    peers: list[PrefillPeer | DecodePeer]
    outboxes: list[PrefillOutbox | DecodeOutbox]
    views: list[RankView]
    server: BootstrapServer | None = None
    tp: int = 0  #: the instance's TP size (0: as many as ``peers``)

    @property
    def size(self) -> int:
        """The instance's TP size, however many of its ranks are held here."""
        return self.tp or len(self.peers)

    def close(self) -> None:
        for peer in self.peers:
            peer.shutdown()
        if self.server is not None:
            self.server.close()


def _rank_fields(
    contract: CacheContract, arena: torch.Tensor, tp: int, rank: int, tunables: PdTunables
) -> dict[str, Any]:
    """What a P and a D rank's peer configuration share here."""
    return {
        "contract": encode_contract(contract).decode(),
        "arena": arena,
        "tp_size": tp,
        "tp_rank": rank,
        "host": LOOPBACK,
        "tunables": tunables,
    }


def start_prefill(
    contract: CacheContract,
    tp: int,
    tunables: PdTunables,
    mooncake_env: dict[str, str] | None = None,
    *,
    only: tuple[int, torch.Tensor] | None = None,
    bootstrap_url: str | None = None,
) -> TspdInstance:
    """A tspd P instance: its bootstrap server (tspd-bootstrap) and one PrefillPeer per rank
    (``mooncake_env``: ``MC_*`` knobs for its workers' Mooncake). ``only``: just this rank,
    over this arena; ``bootstrap_url``: the instance's server, started elsewhere."""
    server = None if bootstrap_url else BootstrapServer(LOOPBACK, 0).start()
    url = bootstrap_url or (server.url if server else "")
    inst = TspdInstance([], [], [], server, tp)
    return _start_ranks(
        inst,
        contract,
        only,
        lambda arena, rank: PrefillPeer.start(
            PrefillPeerConfig(
                **_rank_fields(contract, arena, tp, rank, tunables),
                mooncake_env=mooncake_env or {},
                bootstrap_url=url,
            )
        ),
    )


def start_decode(
    contract: CacheContract,
    tp: int,
    tunables: PdTunables,
    *,
    only: tuple[int, torch.Tensor] | None = None,
) -> TspdInstance:
    """A tspd D replica: one DecodePeer per rank (staging on, as by default); ``only``: just
    this rank, over this arena."""
    return _start_ranks(
        TspdInstance([], [], [], None, tp),
        contract,
        only,
        lambda arena, rank: DecodePeer.start(
            DecodePeerConfig(**_rank_fields(contract, arena, tp, rank, tunables))
        ),
    )


def _start_ranks(
    inst: TspdInstance,
    contract: CacheContract,
    only: tuple[int, torch.Tensor] | None,
    start: Callable[[torch.Tensor, int], tuple[Any, Any]],
) -> TspdInstance:
    """Start ``inst``'s ranks (all, each over an arena of its own; or ``only`` one, over the
    arena given: ``start(arena, rank)`` → peer and outbox); on any failure close what started
    and raise."""
    ranks = [only] if only else [(rank, None) for rank in range(inst.tp)]
    try:
        for rank, given in ranks:
            arena = shared_arena(contract) if given is None else given
            peer, outbox = start(arena, rank)
            inst.peers.append(peer)
            inst.outboxes.append(outbox)
            inst.views.append(RankView(arena.numpy(), contract, inst.tp, rank))
    except BaseException:
        inst.close()
        raise
    return inst


def drive(
    inst: TspdInstance,
    rooms: Sequence[Room_],
    bootstrap: tuple[str, int],
    other_done: Callable[[], bool],
    timeout_s: float = 60.0,
) -> dict[int, dict[RequestId, PdEvent]]:
    """Run ``rooms`` through every rank of ``inst`` until they ended there and ``other_done``
    (the TokenSpeed side answered); each rank's last event per request."""
    return drive_many([inst], rooms, bootstrap, other_done, timeout_s)[0][0]


def drive_many(
    insts: Sequence[TspdInstance],
    rooms: Sequence[Room_],
    bootstrap: tuple[str, int],
    other_done: Callable[[], bool] = lambda: True,
    timeout_s: float = 60.0,
    engine_flow: bool = False,
) -> tuple[list[dict[int, dict[RequestId, PdEvent]]], list[Stamps]]:
    """:func:`drive` for several instances in one loop (D instances first: they register
    first, as their look-up starts the critical path); per instance, each rank's last event
    per request and the rooms' stamps.

    ``engine_flow``: what tspd's engine does by default instead of waiting for Bootstrapped
    (TokenSpeed's executors' way): a D replica of one rank publishes its manifest with the
    registration, and P hands its prompt over with the registration
    (``PdConfig.prefill_early``: its worker holds the chunk until the room is bootstrapped).
    """
    by_rid = {r.rid: r for r in rooms}
    finals: list[dict[int, dict[RequestId, PdEvent]]] = [
        {i: {} for i in range(len(inst.peers))} for inst in insts
    ]
    stamps: list[Stamps] = [{} for _ in insts]
    early: set[tuple[int, int]] = set()  # (instance, rank) that acted with the registration
    for plan in rooms:
        info = BootstrapInfo(bootstrap[0], bootstrap[1], Room(plan.room))
        for k, inst in enumerate(insts):
            for i, peer in enumerate(inst.peers):
                _stamp(stamps[k], plan.room, "registered", len(inst.peers), i)
                d_side = isinstance(inst.outboxes[i], DecodeOutbox)
                solo_d = engine_flow and d_side and inst.size == 1
                # As the engine's decode link: a replica of one rank registers and publishes
                # in one write to its worker.
                with peer.batch() if solo_d else contextlib.nullcontext():
                    peer.register(plan.rid, info)
                    if engine_flow and (inst.size == 1 or not d_side):
                        _act(inst.outboxes[i], inst.views[i].contract, [plan])
                if engine_flow and (inst.size == 1 or not d_side):
                    _stamp(stamps[k], plan.room, "handed", len(inst.peers), i)
                    early.add((k, i))
    ranks = [
        (k, i, peer, inst.outboxes[i], inst.views[i].contract)
        for k, inst in enumerate(insts)
        for i, peer in enumerate(inst.peers)
    ]
    deadline = time.monotonic() + timeout_s
    while any(r[2].has_in_flight() for r in ranks) or not other_done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rooms still in flight after {timeout_s:g} s")
        busy = False
        for k, i, peer, outbox, contract in ranks:
            events = peer.poll()
            busy |= bool(events)
            count = len(insts[k].peers)
            if (k, i) not in early:
                for r in _react(outbox, contract, events, by_rid):
                    _stamp(stamps[k], r.room, "handed", count, i)
            for e in events:
                if not isinstance(e, Bootstrapped):
                    finals[k][i][e.rid] = e
                    _stamp(stamps[k], by_rid[e.rid].room, "done", count, i)
        if not busy:
            mpc.wait([r[2].fileno() for r in ranks], timeout=0.01)
    return finals, stamps


def _stamp(stamps: Stamps, room: int, step: str, count: int, index: int) -> None:
    stamps.setdefault((room, step), [0.0] * count)[index] = time.perf_counter()


def _react(
    outbox: PrefillOutbox | DecodeOutbox,
    contract: CacheContract,
    events: list[PdEvent],
    rooms: dict[RequestId, Room_],
) -> list[Room_]:
    """Publish D's manifests or hand P's prompts over for the rooms bootstrapped now; them."""
    boot = [rooms[e.rid] for e in events if isinstance(e, Bootstrapped)]
    if boot:
        _act(outbox, contract, boot)
    return boot


def _act(
    outbox: PrefillOutbox | DecodeOutbox, contract: CacheContract, boot: Sequence[Room_]
) -> None:
    """D: stage and hand over the manifests of ``boot``; P: its prompts and first tokens."""
    if isinstance(outbox, DecodeOutbox):
        rows = [
            RemotePrefillRow(r.rid, build_manifest(contract, r.d_table, r.prefix_len, r.prompt_len))
            for r in boot
        ]
        outbox.stage_remote_prefill(rows)
        outbox.hand_over_remote_prefill()
        return
    gids = contract.group_ids()
    outbox.stage_remote_decode(
        [RemoteDecodeRow(r.rid, [r.p_table[g] for g in gids], 0, r.prompt_len) for r in boot]
    )
    outbox.hand_over_remote_decode({r.rid: FirstToken(r.token) for r in boot})


def expect_d(rooms: Sequence[Room_]) -> dict[RequestId, PdEvent]:
    return {r.rid: RemotePrefill(r.rid, r.token) for r in rooms}


def expect_p(rooms: Sequence[Room_]) -> dict[RequestId, PdEvent]:
    return {r.rid: Succeeded(r.rid) for r in rooms}


def failed(final: dict[int, dict[RequestId, PdEvent]]) -> list[str]:
    return [
        f"rank {i}: {e.reason}"
        for i, f in final.items()
        for e in f.values()
        if isinstance(e, Failed)
    ]


# ---- identity oracle -------------------------------------------------------------------------


def tag_sources(views: Sequence[RankView], rooms: Sequence[Room_]) -> None:
    for view in views:
        for plan in rooms:
            fill_identity(view, plan.p_table, salt=plan.room)


def noise(views: Sequence[RankView], seed: int) -> list[npt.NDArray[np.uint8]]:
    rng = np.random.default_rng(seed)
    snapshots = []
    for view in views:
        view.arena[:] = rng.integers(0, 256, view.arena.size, dtype=np.uint8)
        snapshots.append(view.arena.copy())
    return snapshots


def verify(
    views: Sequence[RankView], rooms: Sequence[Room_], snapshots: Sequence[npt.NDArray[np.uint8]]
) -> list[str]:
    """Every destination page holds its room's identity; every other byte is unchanged."""
    problems: list[str] = []
    for i, view in enumerate(views):
        contract = view.contract
        touched: dict[str, list[npt.NDArray[np.int64]]] = {g: [] for g in contract.group_ids()}
        for plan in rooms:
            for spec in contract.group_specs:
                span = slot_range(spec, plan.prefix_len, plan.prompt_len)
                slots = np.arange(span.start, span.stop)
                pages = plan.d_table[spec.group_id][slots]
                touched[spec.group_id].append(pages)
                found = check_identity(view, spec.group_id, slots, pages, plan.room)
                problems += [f"D{i} room {plan.room}: {p}" for p in found]
        mask = page_mask(contract, {g: np.concatenate(v) for g, v in touched.items()})
        changed = int((view.arena[~mask] != snapshots[i][~mask]).sum())
        if changed:
            problems.append(f"D{i}: {changed} bytes outside the destination pages changed")
    return problems


def plan_rooms(
    p: CacheContract, d: CacheContract, count: int, seed: int, max_prompt: int = 60
) -> list[Room_]:
    """``count`` concurrent rooms with distinct pages on each side, some with a prefix hit."""
    rng = np.random.default_rng(seed)
    g = p.plan.prefix_granularity
    gid = p.group_ids()[0]
    p_free = rng.permutation(np.arange(1, p.group(gid).page_count))
    d_free = rng.permutation(np.arange(1, d.group(gid).page_count))
    rooms, taken = [], 0
    for n in range(count):
        prompt = int(rng.integers(1, max_prompt + 1))
        slots = -(-prompt // g)
        full = (prompt - 1) // g
        prefix = g * int(rng.integers(0, full + 1)) if n % 3 == 1 else 0
        p_ids, d_ids = p_free[taken : taken + slots], d_free[taken : taken + slots]
        taken += slots
        room = int(rng.integers(0, 2**63 - 1))
        rooms.append(Room_(room, prompt, prefix, {gid: p_ids}, {gid: d_ids}, 100 + n))
    return rooms
