"""The engine-side peer's own metrics: agreement rounds, events, tracked requests.

The worker's metrics (bytes, transfer seconds, failures by cause, queues) come from the worker
(:mod:`tspd_core.pd.metrics.worker`); ``TransferPeer.metrics()`` merges both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from tspd_core.pd.events import Bootstrapped, Failed, PdEvent, RemotePrefill, Succeeded
from tspd_core.pd.metrics.registry import LATENCY_BUCKETS, Labels, MetricsSnapshot, Registry, labels
from tspd_core.pd.status import TransferPoll

if TYPE_CHECKING:
    from tspd_core.pd.peer.transfer_peer import TransferPeer

_EVENT = {Bootstrapped: "bootstrapped", Succeeded: "succeeded", RemotePrefill: "remote_prefill"}


class PeerMetrics:
    """Counters of one engine-side peer (thread-safe; recorded by the polling thread)."""

    def __init__(self, peer: TransferPeer) -> None:
        self._peer = peer
        r = self.registry = Registry()
        self.rounds = r.counter("agreement_rounds_total", "Replica agreement rounds (poll calls)")
        self.poll_s = r.histogram(
            "agreement_seconds", "Time of one poll, MIN all-reduce included", LATENCY_BUCKETS
        )
        self.events = r.counter("events_total", "Events poll returned, by event")
        self.failed = r.counter("failed_requests_total", "Failed events, by cause")
        r.gauge_fn("tracked_requests", "Requests the peer tracks, by phase", self._tracked)
        r.gauge_fn("worker_up", "1 while the transfer worker serves", self._up)
        r.gauge_fn("asleep", "1 while the cache registration is released", self._asleep)

    def round(self, seconds: float, events: Sequence[PdEvent]) -> None:
        r = self.registry
        r.inc(self.rounds)
        r.observe(self.poll_s, seconds)
        for e in events:
            if isinstance(e, Failed):
                r.inc(self.events, at=labels(event="failed"))
                r.inc(self.failed, at=labels(cause=e.cause or "unknown"))
            else:
                r.inc(self.events, at=labels(event=_EVENT[type(e)]))

    def snapshot(self) -> MetricsSnapshot:
        return self.registry.snapshot()

    def _tracked(self) -> Mapping[Labels, float]:
        peer = self._peer
        counts = {"bootstrapping": 0.0, "bootstrapped": 0.0, "failing": 0.0}
        with peer._lock:
            for t in peer._tracked.values():
                name = {
                    TransferPoll.BOOTSTRAPPING: "bootstrapping",
                    TransferPoll.BOOTSTRAPPED: "bootstrapped",
                }.get(t.local, "failing")
                counts[name] += 1
        return {labels(phase=k): v for k, v in counts.items()}

    def _up(self) -> Mapping[Labels, float]:
        up = self._peer._dead is None and self._peer._link.lost is None
        return {(): float(up)}

    def _asleep(self) -> Mapping[Labels, float]:
        return {(): float(self._peer._asleep)}
