"""Aborts in every state of a room, with real peers (worker processes, ZMQ, Mooncake) and the
real scheduler's block pools: exact events on both sides, D's pages held while P may still
write them, every pool whole and nothing tracked afterwards. Also ``abort_room`` ahead of the
request, ``record_usage``, and what the peer answers about a request (tracked, aborted, the
room's request, how much was handed over) instead of an engine's own record.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pytest
import torch

from tspd_core.epd import (
    EmbeddingItem,
    EmbeddingReceiverConfig,
    FailedRequest,
    receiver_for_peer,
)
from tspd_core.ids import RequestId, Room
from tspd_core.layout import ArenaSpec, build_manifest
from tspd_core.pd import (
    BootstrapInfo,
    Bootstrapped,
    DecodeOutbox,
    Failed,
    FirstToken,
    HandOver,
    PdEvent,
    PdTunables,
    PrefillOutbox,
    PrefillPeer,
    RemoteDecodeRow,
    RemotePrefill,
    RemotePrefillRow,
    Succeeded,
    TransferPeer,
    UsageError,
)
from tspd_core.sched import BlockPool
from tspd_testing.identity import check_identity, fill_identity
from tspd_testing.loopback import LoopbackCluster

PAGES = 600
SPEC = ArenaSpec(layers=2, kv_heads=4, head_dim=32, page_size=4, num_pages=PAGES)
# Direct writes cut into 256-byte descriptors: a 128-page room is ~4,000 descriptors, so an
# abort right after the hand-over finds its transfer running (cancelled between batches).
SLOW = PdTunables(stage_below_bytes=0, max_run_bytes=256, bootstrap_timeout_s=30)


@dataclass
class Side:
    """One rank's peer, outbox and block pool, and the pages each request holds."""

    peer: TransferPeer
    outbox: PrefillOutbox | DecodeOutbox
    pool: BlockPool
    held: dict[str, npt.NDArray[np.int64]] = field(default_factory=dict)

    def admit(self, rid: str, pages: int) -> npt.NDArray[np.int64]:
        self.held[rid] = self.pool.allocate(pages).astype(np.int64)
        return self.held[rid]

    def events(self, want: int = 1, timeout_s: float = 20.0) -> list[PdEvent]:
        got: list[PdEvent] = []
        deadline = time.monotonic() + timeout_s
        while len(got) < want and time.monotonic() < deadline:
            for e in self.peer.poll():
                got.append(e)
                if not isinstance(e, Bootstrapped):
                    self.pool.decref(self.held.pop(str(e.rid)))  # final: the pages go back
            self.peer.wait(0.01)
        return got


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopbackCluster]:
    with LoopbackCluster([SPEC], [SPEC], tunables=SLOW) as c:
        yield c


@pytest.fixture
def sides(cluster: LoopbackCluster) -> Iterator[tuple[Side, Side]]:
    p = Side(cluster.p[0].peer, cluster.p[0].outbox, BlockPool(PAGES))
    d = Side(cluster.d[0].peer, cluster.d[0].outbox, BlockPool(PAGES))
    yield p, d
    for side in (p, d):  # nothing leaks: every pool whole, nothing tracked
        assert side.pool.free_count() == PAGES
        assert side.held == {}
        assert not side.peer.has_in_flight()


def _room(n: int) -> tuple[RequestId, Room]:
    return RequestId(f"req-{n}"), Room(1_000_000 + n)


def _register_both(cluster: LoopbackCluster, p: Side, d: Side, n: int, pages: int) -> RequestId:
    rid, room = _room(n)
    info = BootstrapInfo(*cluster.bootstrap, room)
    fill_identity(cluster.p[0].view, {"full_attention": p.admit(rid, pages)}, salt=room)
    d.admit(rid, pages)
    d.peer.register(rid, info)
    p.peer.register(rid, info)
    return rid


def _publish(cluster: LoopbackCluster, d: Side, rid: RequestId, pages: int) -> None:
    assert d.events() == [Bootstrapped(rid)]
    table = {"full_attention": d.held[rid]}
    manifest = build_manifest(cluster.d[0].view.contract, table, 0, 4 * pages)
    assert isinstance(d.outbox, DecodeOutbox)
    d.outbox.stage_remote_prefill([RemotePrefillRow(rid, manifest)])
    assert d.outbox.hand_over_remote_prefill() == 1


def _bootstrapping(peer: TransferPeer) -> float:
    """Rooms P's worker holds that no request of its engine claimed yet (D's pre-allocations)."""
    return peer.metrics().value("tspd_pd_rooms", state="bootstrapping")


def _await(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g} s waiting for {what}"
        time.sleep(0.01)


def _hand_over(p: Side, rid: RequestId, pages: int, token: FirstToken | None = None) -> None:
    assert isinstance(p.outbox, PrefillOutbox)
    p.outbox.stage_remote_decode([RemoteDecodeRow(rid, p.held[rid], 0, 4 * pages)])
    p.outbox.hand_over_remote_decode({rid: token or FirstToken(7)})


@pytest.mark.multiproc
def test_abort_p_while_bootstrapping(sides: tuple[Side, Side], cluster: LoopbackCluster) -> None:
    p, _ = sides
    rid, room = _room(1)
    p.admit(rid, 2)
    p.peer.register(rid, BootstrapInfo(*cluster.bootstrap, room))
    p.peer.abort(rid, "client went away")
    [e] = p.events()
    assert e == Failed(rid, "client went away")
    assert e.cause == "abort"


@pytest.mark.multiproc
def test_abort_p_when_bootstrapped_pushes_failed_to_d(
    sides: tuple[Side, Side], cluster: LoopbackCluster
) -> None:
    p, d = sides
    rid = _register_both(cluster, p, d, 2, 3)
    _publish(cluster, d, rid, 3)
    assert p.events() == [Bootstrapped(rid)]
    p.peer.abort(rid, "client went away")
    assert p.events() == [Failed(rid, "client went away")]
    [e] = d.events()
    assert e == Failed(rid, "P rank 0 aborted the transfer")
    assert e.cause == "remote"


#: Tries at an abort that lands while its room's transfer runs (see the test).
TRIES = 5


@pytest.mark.multiproc
def test_abort_p_while_its_transfer_runs(
    sides: tuple[Side, Side], cluster: LoopbackCluster
) -> None:
    """The abort goes right behind the hand-over, on the same pipe, while the room's ~4,000
    descriptors go out; nothing the test can hold keeps the write running until P's worker
    reads the abort, so each try is checked exactly for what happened (P's counters say
    which), and the test needs a try whose write the abort cancelled."""
    p, d = sides
    seen: list[str] = []
    for n in range(TRIES):
        seen.append(_abort_behind_the_hand_over(cluster, p, d, 300 + n))
        if seen[-1] == "cancelled":
            break
    assert seen[-1] == "cancelled", seen


def _abort_behind_the_hand_over(cluster: LoopbackCluster, p: Side, d: Side, n: int) -> str:
    """One 128-page room aborted on P right after its hand-over: "cancelled" (the write
    stopped between two batches, or before its first), "finished" (it landed first: a
    Success) or "finished, then failed" (it landed, and the abort came before the Success)."""
    rid = _register_both(cluster, p, d, n, 128)
    pages, room = d.held[rid], _room(n)[1]
    _publish(cluster, d, rid, 128)
    assert p.events() == [Bootstrapped(rid)]
    before = cluster.p[0].peer.counters()
    _hand_over(p, rid, 128)
    p.peer.abort(rid, "client went away")
    got = p.events() + d.events()  # D's final event comes once no write of the room runs
    after = cluster.p[0].peer.counters()
    jobs, failed, sent = (after[k] - before[k] for k in ("jobs", "failed_jobs", "bytes"))
    aborted = [Failed(rid, "client went away"), Failed(rid, "P rank 0 aborted the transfer")]
    if failed:
        assert (got, jobs, failed, sent) == (aborted, 1, 1, 0)
        return "cancelled"
    page_bytes = sum(f.payload_bytes for f in cluster.p[0].view.contract.plan.fields)
    assert (jobs, sent) == (1, 128 * page_bytes)
    if got == aborted:
        return "finished, then failed"
    assert got == [Succeeded(rid), RemotePrefill(rid, 7)]
    view = cluster.d[0].view
    assert check_identity(view, "full_attention", np.arange(128), pages, room) == []
    return "finished"


@pytest.mark.multiproc
def test_abort_after_the_final_event_is_a_usage_error(
    sides: tuple[Side, Side], cluster: LoopbackCluster
) -> None:
    p, d = sides
    rid = _register_both(cluster, p, d, 4, 2)
    _publish(cluster, d, rid, 2)
    assert p.events() == [Bootstrapped(rid)]
    _hand_over(p, rid, 2)
    assert p.events() == [Succeeded(rid)]
    assert d.events() == [RemotePrefill(rid, 7)]
    with pytest.raises(UsageError, match="is not registered"):
        p.peer.abort(rid, "too late")


@pytest.mark.multiproc
def test_abort_d_while_looking_p_up(sides: tuple[Side, Side]) -> None:
    _, d = sides
    with socket.socket() as blackhole:  # takes the look-up's connection, never answers
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(1)
        blackhole.settimeout(30)
        rid, room = _room(5)
        d.admit(rid, 2)
        d.peer.register(rid, BootstrapInfo("127.0.0.1", blackhole.getsockname()[1], room))
        lookup, _ = blackhole.accept()  # the look-up is under way, and it hangs
        with lookup:
            d.peer.abort(rid, "client went away")
            assert d.events() == [Failed(rid, "client went away")]
            # The room failed while its look-up still waits for an answer (its client closes
            # the connection only at its 5 s read timeout): the abort did not wait for it.
            lookup.setblocking(False)
            while True:
                try:
                    chunk = lookup.recv(65536)  # the request, never EOF: still connected
                except BlockingIOError:
                    break
                assert chunk, "the look-up gave up before the room failed"


@pytest.mark.multiproc
def test_abort_d_before_its_manifest(sides: tuple[Side, Side], cluster: LoopbackCluster) -> None:
    _, d = sides
    rid, room = _room(6)
    d.admit(rid, 2)
    d.peer.register(rid, BootstrapInfo(*cluster.bootstrap, room))
    assert d.events() == [Bootstrapped(rid)]
    d.peer.abort(rid, "client went away")
    assert d.events() == [Failed(rid, "client went away")]


@pytest.mark.multiproc
def test_abort_d_waiting_holds_its_pages_until_p_answers(
    sides: tuple[Side, Side], cluster: LoopbackCluster
) -> None:
    p, d = sides
    rid = _register_both(cluster, p, d, 7, 4)
    _publish(cluster, d, rid, 4)
    assert p.events() == [Bootstrapped(rid)]
    d.peer.abort(rid, "client went away")
    # A call answered after the abort (one pipe, read in order): D's worker has failed the
    # room before P's Success below can reach it.
    d.peer.counters()
    assert d.events(timeout_s=0.5) == []  # P may write any moment: the pages stay held
    assert rid in d.held
    _hand_over(p, rid, 4)  # P never heard of the abort: it writes, then says Success
    assert p.events() == [Succeeded(rid)]
    assert d.events() == [Failed(rid, "client went away")]


@pytest.mark.multiproc
def test_abort_room_ahead_of_the_request(
    sides: tuple[Side, Side], cluster: LoopbackCluster
) -> None:
    """EPD: the prefill gave up before its engine registered the P->D room. D's
    pre-allocation gets Failed at once, and a late register of the room fails too."""
    p, d = sides
    rid, room = _room(8)
    assert isinstance(p.peer, PrefillPeer)
    p.peer.abort_room(room, "EPD embeddings: timed out")
    p.peer.counters()  # answered after the abort (one pipe, read in order): P's worker has it
    d.admit(rid, 2)
    d.peer.register(rid, BootstrapInfo(*cluster.bootstrap, room))
    _publish(cluster, d, rid, 2)
    [e] = d.events(timeout_s=5.0)
    assert e == Failed(rid, "P rank 0 aborted the transfer")
    p.admit(rid, 2)
    p.peer.register(rid, BootstrapInfo(*cluster.bootstrap, room))
    assert p.events() == [Failed(rid, "EPD embeddings: timed out")]


@pytest.mark.multiproc
def test_abort_room_of_a_pre_allocated_room(
    sides: tuple[Side, Side], cluster: LoopbackCluster
) -> None:
    p, d = sides
    rid, room = _room(9)
    before = _bootstrapping(p.peer)
    d.admit(rid, 2)
    d.peer.register(rid, BootstrapInfo(*cluster.bootstrap, room))
    _publish(cluster, d, rid, 2)
    assert isinstance(p.peer, PrefillPeer)
    _await(lambda: _bootstrapping(p.peer) == before + 1, "P to hold D's pre-allocation")
    assert d.events(timeout_s=0.5) == []  # waiting for P, which has not registered it
    p.peer.abort_room(room, "EPD embeddings: failed")
    assert d.events(timeout_s=5.0) == [Failed(rid, "P rank 0 aborted the transfer")]


@pytest.mark.multiproc
def test_record_usage_travels_with_success(
    sides: tuple[Side, Side], cluster: LoopbackCluster
) -> None:
    p, d = sides
    rid = _register_both(cluster, p, d, 10, 3)
    assert isinstance(p.peer, PrefillPeer)
    with pytest.raises(UsageError, match="bootstrap_logprob must be <= 0"):
        p.peer.record_usage(rid, 8, 0.5)
    with pytest.raises(UsageError, match="cached_tokens must be >= 0"):
        p.peer.record_usage(rid, -1)
    p.peer.record_usage(rid, 8, -0.25)
    _publish(cluster, d, rid, 3)
    assert p.events() == [Bootstrapped(rid)]
    _hand_over(p, rid, 3, FirstToken(9, spec_ids=(4, 5)))
    with pytest.raises(UsageError, match="handed over already"):
        p.peer.record_usage(rid, 8)
    assert p.events() == [Succeeded(rid)]
    view, pages = cluster.d[0].view, d.held[rid]
    assert check_identity(view, "full_attention", np.arange(3), pages, 1_000_010) == []
    assert d.events() == [RemotePrefill(rid, 9, (4, 5), 8, -0.25)]


@pytest.mark.multiproc
def test_epd_failure_aborts_the_decode_room_at_once(
    sides: tuple[Side, Side], cluster: LoopbackCluster
) -> None:
    """A request whose embeddings never arrive (no encode node at its address) fails on the
    prefill side; the receiver aborts its P->D room through the prefill peer, so the decode
    rank waiting for the KV gets Failed now, not after P's 30 s bootstrap timeout."""
    _, d = sides
    rid, room = _room(11)
    d.admit(rid, 2)
    d.peer.register(rid, BootstrapInfo(*cluster.bootstrap, room))
    _publish(cluster, d, rid, 2)
    assert isinstance(cluster.p[0].peer, PrefillPeer)
    config = EmbeddingReceiverConfig(hidden=8, dtype=torch.bfloat16, pool_bytes=1 << 20)
    receiver = receiver_for_peer(cluster.p[0].peer, config)
    try:
        with socket.socket() as closed:  # bound, never listening: connecting is refused
            closed.bind(("127.0.0.1", 0))
            nowhere = closed.getsockname()[1]
            receiver.stage(rid, [EmbeddingItem(Room(5), "127.0.0.1", nowhere, 4)], pd_room=room)
            t0 = time.monotonic()
            failed: list[FailedRequest] = []
            while not failed and time.monotonic() - t0 < 15:
                failed += receiver.settle().failed
                receiver.wait(0.02)
        assert [f.rid for f in failed] == [rid]
        [e] = d.events(timeout_s=5.0)
        assert e == Failed(rid, "P rank 0 aborted the transfer")
        assert time.monotonic() - t0 < 10.0
    finally:
        receiver.shutdown()


@pytest.mark.multiproc
def test_the_peer_answers_what_an_engine_would_record(
    sides: tuple[Side, Side], cluster: LoopbackCluster
) -> None:
    """A P request's phase lives in the peer: handed over (NOTHING, then DONE once the
    hand-over went out), which request holds its room, and, for one aborted, that it was."""
    p, d = sides
    assert isinstance(p.peer, PrefillPeer)
    rid = _register_both(cluster, p, d, 12, 2)
    room = _room(12)[1]
    answers = [p.peer.tracks(rid), p.peer.room_request(room), p.peer.aborted(rid)]
    assert answers == [True, rid, False]
    assert p.peer.handed(rid) is HandOver.NOTHING
    _publish(cluster, d, rid, 2)
    assert p.events() == [Bootstrapped(rid)]
    _hand_over(p, rid, 2)
    assert p.peer.handed(rid) is HandOver.DONE
    assert not p.outbox.remote_decode_pending()
    assert p.events() == [Succeeded(rid)]
    assert [p.peer.tracks(rid), p.peer.room_request(room)] == [False, None]
    for ask in (p.peer.handed, p.peer.aborted):
        with pytest.raises(UsageError, match="not registered"):
            ask(rid)
    assert d.events() == [RemotePrefill(rid, 7)]

    other, other_room = _room(13)
    p.admit(other, 2)
    p.peer.register(other, BootstrapInfo(*cluster.bootstrap, other_room))
    p.peer.abort(other, "client went away")
    p.peer.abort(other, "a second reason")  # the room fails once: the first reason stays
    answers = [p.peer.aborted(other), p.peer.handed(other), p.peer.room_request(other_room)]
    assert answers == [True, HandOver.NOTHING, other]
    assert p.events() == [Failed(other, "client went away")]
    assert p.peer.room_request(other_room) is None
