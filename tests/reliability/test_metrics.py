"""Operator metrics from real peers: exact counts, read from another thread while rooms move.

An HTTP handler reads ``peer.metrics()`` on its own thread while the scheduler thread polls;
the worker's answers and the room updates share one pipe, so this checks that no update is
lost or reordered whichever thread drains it (every room still completes), and that the
numbers are exact: bytes, descriptors, rooms, events, latencies, the Prometheus text.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tspd_core.layout import ArenaSpec, slot_range
from tspd_core.pd import (
    Bootstrapped,
    MetricsSnapshot,
    PdEvent,
    PdTunables,
    RemotePrefill,
    Succeeded,
)
from tspd_testing.loopback import LoopbackCluster, plan_rooms

SPEC = ArenaSpec(layers=2, kv_heads=4, head_dim=16, page_size=4, num_pages=600)
ROOMS = 30


@pytest.mark.multiproc
def test_metrics_are_exact_and_safe_to_read_from_another_thread() -> None:
    direct = PdTunables(stage_below_bytes=0)  # direct writes: one descriptor per page field
    with LoopbackCluster([SPEC], [SPEC], tunables=direct) as c:
        rooms = plan_rooms(c.p[0].view.contract, c.d[0].view.contract, ROOMS, 40, seed=3)
        snapshots = c.tag(rooms)
        reads: list[MetricsSnapshot] = []
        stop, seen_busy = threading.Event(), threading.Event()

        def scrape() -> None:  # what a /metrics handler does, as fast as it can
            while not stop.is_set():
                reads.append(c.p[0].peer.metrics())
                reads.append(c.d[0].peer.metrics())
                if len(reads) > 10 and _busy(reads[-1]) > 0:
                    seen_busy.set()

        # The first time D reports rooms Bootstrapped, the driver waits (before it publishes
        # their manifests, so they stay in flight) until the scraper has read more than 10
        # snapshots and seen a room in flight: both are then facts, not a matter of speed.
        d_poll = c.d[0].peer.poll

        def poll_then_let_the_scraper_look() -> list[PdEvent]:
            events = d_poll()
            if any(isinstance(e, Bootstrapped) for e in events) and not seen_busy.is_set():
                assert seen_busy.wait(60), "the scraper never saw a room in flight"
            return events

        c.d[0].peer.poll = poll_then_let_the_scraper_look  # type: ignore[method-assign]
        scraper = threading.Thread(target=scrape)
        scraper.start()
        try:
            out = c.drive(rooms, timeout_s=120)
        finally:
            stop.set()
            scraper.join()
            c.d[0].peer.poll = d_poll  # type: ignore[method-assign]
        assert out.final("p", 0) == {r.rid: Succeeded(r.rid) for r in rooms}
        assert out.final("d", 0) == {r.rid: RemotePrefill(r.rid, r.token) for r in rooms}
        assert c.verify(rooms, snapshots) == []
        assert len(reads) > 10
        p, d = c.p[0].peer.metrics(), c.d[0].peer.metrics()
    contract = c.p[0].view.contract
    spec = contract.group_specs[0]
    pages = sum(len(slot_range(spec, r.prefix_len, r.prompt_len)) for r in rooms)
    fields = contract.plan.fields
    sent = pages * sum(f.payload_bytes for f in fields)
    assert p.value("tspd_pd_transfer_bytes_total") == sent
    assert p.value("tspd_pd_transfer_descriptors_total") <= pages * len(fields)  # coalesced
    assert p.value("tspd_pd_transfer_jobs_total", result="ok") == ROOMS
    assert p.value("tspd_pd_transfer_seconds") == ROOMS  # a histogram's count
    assert p.value("tspd_pd_status_pushes_total", status="success") == ROOMS
    for snap in (p, d):
        assert snap.value("tspd_pd_rooms_succeeded_total") == ROOMS
        assert snap.value("tspd_pd_room_latency_seconds") == ROOMS
        assert snap.total("tspd_pd_room_failures_total") == 0
        assert snap.value("tspd_pd_tracked_requests", phase="bootstrapped") == 0
        assert snap.value("tspd_pd_worker_up") == 1.0
    assert p.value("tspd_pd_events_total", event="succeeded") == ROOMS
    assert d.value("tspd_pd_events_total", event="remote_prefill") == ROOMS
    assert p.value("tspd_pd_events_total", event="bootstrapped") == ROOMS
    text = p.render({"role": "prefill", "rank": 0})
    bytes_line = f'tspd_pd_transfer_bytes_total{{rank="0",role="prefill"}} {sent}'
    assert bytes_line in text.splitlines()
    assert "# TYPE tspd_pd_room_latency_seconds histogram" in text
    busy = [_busy(s) for s in reads]
    assert max(busy) > 0  # the scraper saw rooms in flight
    assert np.all(np.diff([s.value("tspd_pd_agreement_rounds_total") for s in reads[::2]]) >= 0)


def _busy(snapshot: MetricsSnapshot) -> float:
    """Requests the peer tracks as Bootstrapped: rooms in flight."""
    return snapshot.value("tspd_pd_tracked_requests", phase="bootstrapped")
