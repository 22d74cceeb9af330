"""Each side hands its part over before Bootstrapped (docs/pd.md), and its worker holds it.

D (a replica of one rank) hands its manifest over with the registration: the worker sends the
pre-allocations the moment its look-up finished, so P gets Bootstrapped without D's engine
ever polling. P hands its prefilled chunk over before D pre-allocated: the worker writes it
the moment the room is Bootstrapped. An engine polling afterwards gets Bootstrapped and then
its final event in the next round (one event per request per round).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from tspd_core.ids import RequestId, Room
from tspd_core.layout import ArenaSpec, build_manifest
from tspd_core.pd import (
    BootstrapInfo,
    Bootstrapped,
    DecodeOutbox,
    Failed,
    FirstToken,
    PdTunables,
    PrefillOutbox,
    RemoteDecodeRow,
    RemotePrefill,
    RemotePrefillRow,
    Succeeded,
    TransferPeer,
)
from tspd_testing.loopback import LoopbackCluster, RoomPlan, plan_rooms, poll_events

from .conftest import UnusedPorts

SPEC = ArenaSpec(layers=2, kv_heads=2, head_dim=8, page_size=4, num_pages=32)
GID = "full_attention"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopbackCluster]:
    with LoopbackCluster([SPEC], [SPEC], tunables=PdTunables()) as c:
        yield c


def _plan(n: int) -> RoomPlan:
    p_pages, d_pages = np.array([1 + 2 * n, 2 + 2 * n]), np.array([20 - n, 25 - n])
    return RoomPlan(RequestId(f"early-{n}"), Room(5000 + n), 7, 0, {GID: p_pages}, {GID: d_pages})


def _succeeded(peer: TransferPeer) -> float:
    """Rooms the peer's worker saw reach Success (P's answer arrived, on D)."""
    return peer.metrics().value("tspd_pd_rooms_succeeded_total")


def _stage(cluster: LoopbackCluster, plan: RoomPlan) -> DecodeOutbox:
    d = cluster.d[0]
    assert isinstance(d.outbox, DecodeOutbox)
    manifest = build_manifest(d.view.contract, plan.d_table, plan.prefix_len, plan.prompt_len)
    d.outbox.stage_remote_prefill([RemotePrefillRow(plan.rid, manifest)])
    return d.outbox


@pytest.mark.multiproc
def test_p_is_bootstrapped_before_d_s_engine_polls_and_d_gets_both_events(
    cluster: LoopbackCluster,
) -> None:
    plan = _plan(0)
    snapshots = cluster.tag([plan])
    p, d = cluster.p[0], cluster.d[0]
    succeeded = _succeeded(d.peer)
    info = BootstrapInfo(*cluster.bootstrap, plan.room)
    d.peer.register(plan.rid, info)
    assert _stage(cluster, plan).hand_over_remote_prefill() == 1  # before any poll
    p.peer.register(plan.rid, info)
    assert poll_events(p.peer) == [Bootstrapped(plan.rid)]  # D's engine never polled
    assert isinstance(p.outbox, PrefillOutbox)
    p.outbox.stage_remote_decode([RemoteDecodeRow(plan.rid, [plan.p_table[GID]], 0, 7)])
    p.outbox.hand_over_remote_decode({plan.rid: FirstToken(42)})
    assert poll_events(p.peer) == [Succeeded(plan.rid)]
    # P pushed Success before reporting, but it still has to reach D's worker: wait until the
    # worker counted it (the metrics call also hands its note to the peer). With both states
    # known, D's engine gets two rounds, one event each.
    deadline = time.monotonic() + 20
    while _succeeded(d.peer) == succeeded:
        assert time.monotonic() < deadline, "D's worker never got P's Success"
        time.sleep(0.01)
    assert d.peer.poll() == [Bootstrapped(plan.rid)]
    assert d.peer.poll() == [RemotePrefill(plan.rid, 42)]
    assert not d.peer.has_in_flight()
    assert cluster.verify([plan], snapshots) == []


@pytest.mark.multiproc
def test_a_second_manifest_fails_the_room_and_nothing_goes_out(
    cluster: LoopbackCluster, unused_ports: UnusedPorts
) -> None:
    # A silent bootstrap server: the look-up hangs for its 5 s timeout, so both manifests
    # reach the worker while the room is still Bootstrapping.
    plan = _plan(1)
    d, p_rooms = cluster.d[0], cluster.p[0].peer.counters()["rooms"]
    d.peer.register(plan.rid, BootstrapInfo("127.0.0.1", unused_ports.silent(), plan.room))
    outbox = _stage(cluster, plan)
    _stage(cluster, plan)
    assert outbox.hand_over_remote_prefill() == 2
    [event] = poll_events(d.peer)  # quiet at once: the held manifest never went out
    assert event == Failed(plan.rid, "a second manifest handed over")
    assert cluster.p[0].peer.counters()["rooms"] == p_rooms  # P never heard of the room


@pytest.mark.multiproc
def test_a_held_manifest_of_a_room_whose_look_up_fails_never_goes_out(
    cluster: LoopbackCluster, unused_ports: UnusedPorts
) -> None:
    plan = _plan(2)
    d, p_rooms = cluster.d[0], cluster.p[0].peer.counters()["rooms"]
    port = unused_ports.refused()
    d.peer.register(plan.rid, BootstrapInfo("127.0.0.1", port, plan.room))
    assert _stage(cluster, plan).hand_over_remote_prefill() == 1
    [event] = poll_events(d.peer)  # quiet at once: no pre-allocation went anywhere
    assert isinstance(event, Failed)
    assert event.reason.startswith(f"bootstrap 127.0.0.1:{port}:")
    assert cluster.p[0].peer.counters()["rooms"] == p_rooms  # P never heard of the room


@pytest.mark.multiproc
def test_p_prefilled_early_writes_each_room_the_moment_d_pre_allocates() -> None:
    with LoopbackCluster([SPEC], [SPEC], early_prefill=True) as c:
        rooms = plan_rooms(c.p[0].view.contract, c.d[0].view.contract, 6, 24, seed=3)
        snapshots = c.tag(rooms)
        out = c.drive(rooms)
        for rank in ("p", "d"):
            events = out.events[(rank, 0)]
            final = Succeeded if rank == "p" else RemotePrefill
            for r in rooms:  # Bootstrapped, then the final event in a later round
                mine = [e for e in events if e.rid == r.rid]
                assert [type(e) for e in mine] == [Bootstrapped, final], (rank, r.rid, mine)
        assert c.verify(rooms, snapshots) == []


@pytest.mark.multiproc
def test_a_chunk_held_for_a_room_d_never_pre_allocates_is_dropped_unread() -> None:
    fast = PdTunables(bootstrap_timeout_s=1.0)
    with LoopbackCluster([SPEC], [SPEC], tunables=fast) as c:
        p = c.p[0]
        rid, room = RequestId("alone"), Room(6001)
        p.peer.register(rid, BootstrapInfo(*c.bootstrap, room))
        assert isinstance(p.outbox, PrefillOutbox)
        p.outbox.stage_remote_decode([RemoteDecodeRow(rid, np.array([3, 4]), 0, 7)])
        assert p.outbox.hand_over_remote_decode({rid: FirstToken(9)}) == 1
        [event] = poll_events(p.peer)
        assert event == Failed(rid, "still bootstrapping after 1 s")
        assert p.peer.counters()["jobs"] == 0  # nothing of the held chunk was written
