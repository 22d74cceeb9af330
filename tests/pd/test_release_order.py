"""When the engine side tells its worker to forget a request: a succeeded one with the next
call (cleanup that must not delay the event), a failed one at once (P's Failed push hangs on it).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tspd_core.ids import RequestId, Room
from tspd_core.layout import ArenaSpec
from tspd_core.pd import (
    BootstrapInfo,
    Failed,
    PdEvent,
    PdTunables,
    RemotePrefill,
    Succeeded,
    TransferPeer,
)
from tspd_core.pd.wire import ipc
from tspd_testing.loopback import LoopbackCluster, RoomPlan

SPEC = ArenaSpec(layers=2, kv_heads=4, head_dim=8, page_size=4, num_pages=64)


class Recorder:
    """Wraps a peer's poll and its worker's send: the releases each poll sent, and its events."""

    def __init__(self, peer: TransferPeer) -> None:
        self.polls: list[tuple[list[PdEvent], list[tuple[int, bool]]]] = []
        self.sent: list[tuple[int, bool]] = []
        send, poll = peer._worker.send, peer.poll

        def spy_send(msg: ipc.Message) -> None:
            if isinstance(msg, ipc.ReleaseRoom):
                self.sent.append((int(msg.room), msg.failed))
            send(msg)

        def spy_poll() -> list[PdEvent]:
            before = len(self.sent)
            events = poll()
            self.polls.append((events, self.sent[before:]))
            return events

        peer._worker.send = spy_send  # type: ignore[method-assign]
        peer.poll = spy_poll  # type: ignore[assignment,method-assign]

    def releases_in_the_final_poll(self, rid: RequestId) -> list[tuple[int, bool]]:
        """The releases sent by the poll that returned the request's final event."""
        final = (Failed, RemotePrefill, Succeeded)
        return next(
            sent
            for events, sent in self.polls
            if any(e.rid == rid and isinstance(e, final) for e in events)
        )


@pytest.mark.multiproc
def test_a_succeeded_release_rides_with_the_next_call_a_failed_one_goes_at_once() -> None:
    with LoopbackCluster([SPEC], [SPEC], tunables=PdTunables()) as cluster:
        p, d = Recorder(cluster.p[0].peer), Recorder(cluster.d[0].peer)
        plan = RoomPlan(
            RequestId("ok"),
            Room(501),
            8,
            0,
            {"full_attention": np.array([1, 2])},
            {"full_attention": np.array([3, 4])},
            7,
        )
        outcome = cluster.drive([plan])
        assert outcome.final("d", 0) == {plan.rid: RemotePrefill(plan.rid, 7)}
        assert outcome.final("p", 0) == {plan.rid: Succeeded(plan.rid)}
        assert [r.releases_in_the_final_poll(plan.rid) for r in (p, d)] == [[], []]
        assert cluster.p[0].peer.counters()["rooms"] == 0  # counters() hands them over first
        cluster.d[0].peer.poll()
        assert (p.sent, d.sent) == ([(501, False)], [(501, False)])
        # A request that fails: its release goes out inside the poll that reports Failed.
        host, port = cluster.bootstrap
        peer = cluster.d[0].peer
        peer.register(RequestId("gone"), BootstrapInfo(host, port, Room(502)))
        peer.abort(RequestId("gone"), "client went away")
        events: list[PdEvent] = []
        deadline = time.monotonic() + 20
        while not any(isinstance(e, Failed) for e in events):
            assert time.monotonic() < deadline, f"no Failed event: {events}"
            events += peer.poll()
            peer.wait(0.05)
        assert events[-1] == Failed(RequestId("gone"), "client went away", "abort")
        assert d.releases_in_the_final_poll(RequestId("gone")) == [(502, True)]
