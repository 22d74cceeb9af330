"""The metrics a transfer worker keeps (both roles), on
:class:`tspd_core.pd.metrics.registry.Registry`.

Recorded where things happen: room outcomes on the control thread, transfer jobs on the
transfer threads (the registry is thread-safe); gauges (rooms by state, queue lengths,
sessions) are read on the control thread when the engine asks for a snapshot.

Names (prefix ``tspd_pd_``): ``room_failures_total{cause}``, ``rooms_succeeded_total``,
``room_latency_seconds`` (register -> Success on this rank), ``rejected_messages_total{source}``,
``rooms{state}``; P: ``transfer_bytes_total``, ``transfer_descriptors_total``,
``transfer_wire_descriptors_total`` (what the engine was handed: after staging, long runs cut),
``transfer_jobs_total{result}``, ``transfer_staged_jobs_total``, ``transfer_seconds``,
``transfer_gbps``, ``handover_seconds`` (a room's final chunk in -> Success sent: the forward
done to the KV written), ``transfer_queue_jobs{queue}``, ``d_sessions``, ``failed_sessions``,
``status_pushes_total{status}``, ``refused_seals_total{message, reason}``; D:
``heartbeat_probes_total{result}``, ``heartbeat_node_failures_total``,
``bootstrap_lookups_total{result}``, ``endpoint_drops_total``, ``scatter_queue``,
``scatters_total{result}``, ``scattered_bytes_total``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tspd_core.pd.config import WorkerRole
from tspd_core.pd.metrics.registry import (
    LATENCY_BUCKETS,
    SPEED_BUCKETS,
    Labels,
    MetricsSnapshot,
    Registry,
    labels,
)

Reader = Callable[[], Mapping[Labels, float]]


class WorkerMetrics:
    """One worker's registry and the names it records under."""

    def __init__(self, role: WorkerRole) -> None:
        r = self.registry = Registry()
        self.failures = r.counter("room_failures_total", "Rooms failed on this rank, by cause")
        self.succeeded = r.counter("rooms_succeeded_total", "Rooms that reached Success")
        self.latency = r.histogram(
            "room_latency_seconds", "Register -> Success of a room on this rank", LATENCY_BUCKETS
        )
        self.rejected = r.counter(
            "rejected_messages_total", "Malformed or refused messages dropped, by source"
        )
        if role is WorkerRole.PREFILL:
            self._prefill(r)
        else:
            self._decode(r)

    def _prefill(self, r: Registry) -> None:
        self.bytes = r.counter("transfer_bytes_total", "KV bytes written to D ranks")
        self.descriptors = r.counter("transfer_descriptors_total", "Copy descriptors written")
        self.jobs = r.counter("transfer_jobs_total", "Write jobs (one room to one D rank)")
        self.staged = r.counter("transfer_staged_jobs_total", "Jobs moved through D staging")
        self.job_s = r.histogram("transfer_seconds", "Time of one write job", LATENCY_BUCKETS)
        self.handover = r.histogram(
            "handover_seconds",
            "P: a room's final chunk in -> Success sent (its KV written)",
            LATENCY_BUCKETS,
        )
        self.speed = r.histogram("transfer_gbps", "Speed of one write job (GB/s)", SPEED_BUCKETS)
        self.pushes = r.counter("status_pushes_total", "Status frames pushed to D, by status")
        self.refused_seals = r.counter(
            "refused_seals_total",
            "D registrations and stage offers dropped for want of a good cluster credential "
            "seal, by message and reason",
        )

    def _decode(self, r: Registry) -> None:
        self.probes = r.counter("heartbeat_probes_total", "Bootstrap /health probes, by result")
        self.node_failures = r.counter(
            "heartbeat_node_failures_total", "P instances declared dead by the heartbeat"
        )
        self.lookups = r.counter("bootstrap_lookups_total", "Bootstrap look-ups, by result")
        self.endpoint_drops = r.counter(
            "endpoint_drops_total",
            "Cached P rank addresses dropped because a room of theirs failed (looked up again)",
        )

    def watch(self, kind: str, name: str, help: str, read: Reader) -> None:
        """Declare a gauge (or a counter kept elsewhere) read at snapshot time."""
        if kind == "counter":
            self.registry.counter_fn(name, help, read)
        else:
            self.registry.gauge_fn(name, help, read)

    def room_failed(self, cause: str) -> None:
        self.registry.inc(self.failures, at=labels(cause=cause or "unknown"))

    def room_succeeded(self, seconds: float) -> None:
        self.registry.inc(self.succeeded)
        self.registry.observe(self.latency, seconds)

    def handed_over(self, seconds: float) -> None:
        """P: a room's hand-over, its final chunk in to Success sent (control thread)."""
        self.registry.observe(self.handover, seconds)

    def message_rejected(self, source: str) -> None:
        self.registry.inc(self.rejected, at=labels(source=source))

    def job_done(self, nbytes: int, descriptors: int, staged: bool, ok: bool, s: float) -> None:
        """A P write job finished (on a transfer thread)."""
        r = self.registry
        r.inc(self.jobs, at=labels(result="ok" if ok else "failed"))
        r.inc(self.descriptors, descriptors)
        r.observe(self.job_s, s)
        if staged:
            r.inc(self.staged)
        if ok:
            r.inc(self.bytes, nbytes)
            if s > 0 and nbytes:
                r.observe(self.speed, nbytes / s / 1e9)

    def pushed(self, status: str) -> None:
        """P pushed a status frame to a D session."""
        self.registry.inc(self.pushes, at=labels(status=status))

    def snapshot(self) -> MetricsSnapshot:
        return self.registry.snapshot()
