"""The engine-side peer's own metrics: agreement rounds, events, tracked requests.

The worker's metrics (bytes, transfer seconds, failures by cause, queues) come from the worker
(:mod:`tspd_core.pd.metrics.worker`); ``TransferPeer.metrics()`` merges both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from tspd_core.pd.events import Bootstrapped, Failed, PdEvent, RemotePrefill, Succeeded
from tspd_core.pd.metrics.registry import LATENCY_BUCKETS, Labels, MetricsSnapshot, Registry, labels

_EVENT = {Bootstrapped: "bootstrapped", Succeeded: "succeeded", RemotePrefill: "remote_prefill"}


class PeerGauges(Protocol):
    """What the gauges read from the peer, when a snapshot is taken (any thread)."""

    def phase_counts(self) -> Mapping[str, int]:
        """Tracked requests by phase (bootstrapping, bootstrapped, failing)."""
        ...

    def worker_up(self) -> bool: ...

    def asleep(self) -> bool: ...


class PeerMetrics:
    """Counters of one engine-side peer (thread-safe; recorded by the polling thread)."""

    def __init__(self, peer: PeerGauges) -> None:
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
        return {labels(phase=k): float(v) for k, v in self._peer.phase_counts().items()}

    def _up(self) -> Mapping[Labels, float]:
        return {(): float(self._peer.worker_up())}

    def _asleep(self) -> Mapping[Labels, float]:
        return {(): float(self._peer.asleep())}
