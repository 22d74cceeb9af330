"""When the engine side tells its worker to forget a request: a succeeded one with the next
write (cleanup that must not delay the event, nor cost a wake-up of its own), a failed one at
once (P's Failed push hangs on it).
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
from tspd_core.pd.proc.handle import unpack_batch
from tspd_core.pd.wire import ipc
from tspd_testing.loopback import LoopbackCluster, RoomPlan

SPEC = ArenaSpec(layers=2, kv_heads=4, head_dim=8, page_size=4, num_pages=64)


class Recorder:
    """Spies on a peer's poll and on its worker's command pipe: the messages of each write
    (a batch frame unpacked), and per poll its events and the writes it made."""

    def __init__(self, peer: TransferPeer) -> None:
        self.writes: list[list[ipc.Message]] = []
        self.polls: list[tuple[list[PdEvent], list[list[ipc.Message]]]] = []
        pipe = peer._worker._commands
        send_bytes, poll = pipe.send_bytes, peer.poll

        def spy_send_bytes(frame: bytes) -> None:
            self.writes.append([ipc.decode(m) for m in unpack_batch(frame)])
            send_bytes(frame)

        def spy_poll() -> list[PdEvent]:
            before = len(self.writes)
            events = poll()
            self.polls.append((events, self.writes[before:]))
            return events

        pipe.send_bytes = spy_send_bytes  # type: ignore[method-assign]
        peer.poll = spy_poll  # type: ignore[assignment,method-assign]

    @staticmethod
    def ends(events: list[PdEvent], rid: RequestId) -> bool:
        """Whether ``events`` hold the request's final event."""
        final = (Failed, RemotePrefill, Succeeded)
        return any(e.rid == rid and isinstance(e, final) for e in events)

    def writes_of_the_final_poll(self, rid: RequestId) -> list[list[ipc.Message]]:
        return next(writes for events, writes in self.polls if self.ends(events, rid))


@pytest.mark.multiproc
def test_a_succeeded_release_rides_with_the_next_write_a_failed_one_goes_at_once() -> None:
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
        assert [r.writes_of_the_final_poll(plan.rid) for r in (p, d)] == [[], []]
        released = ipc.ReleaseRoom(Room(501), "", False)
        # No command follows (the drive only polls): each rank's release is held through the
        # next poll (it could ride with a command), then the poll after writes it alone.
        for r, rank in ((p, cluster.p[0]), (d, cluster.d[0])):
            rank.peer.poll()
            rank.peer.poll()
            final = next(k for k, (events, _) in enumerate(r.polls) if r.ends(events, plan.rid))
            after = [writes for _, writes in r.polls[final:]]
            assert after[:3] == [[], [], [[released]]], after
            assert all(writes == [] for writes in after[3:]), after
        assert cluster.p[0].peer.counters()["rooms"] == 0
        host, port = cluster.bootstrap
        peer = cluster.d[0].peer
        d.writes.clear()
        peer.register(RequestId("gone"), BootstrapInfo(host, port, Room(502)))
        assert d.writes == [[ipc.TrackRoom(Room(502), host, port)]]
        # A request that fails: its release goes out inside the poll that reports Failed.
        peer.abort(RequestId("gone"), "client went away")
        events: list[PdEvent] = []
        deadline = time.monotonic() + 20
        while not any(isinstance(e, Failed) for e in events):
            assert time.monotonic() < deadline, f"no Failed event: {events}"
            events += peer.poll()
            peer.wait(0.05)
        assert events[-1] == Failed(RequestId("gone"), "client went away", "abort")
        assert d.writes_of_the_final_poll(RequestId("gone")) == [
            [ipc.ReleaseRoom(Room(502), "client went away", True)]
        ]
