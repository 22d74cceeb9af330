"""Operator metrics of the PD peers: a small registry and its Prometheus text rendering.

Each transfer worker keeps a :class:`Registry` (bytes, descriptors, transfer seconds, room
latencies, failures by cause, queue lengths, rooms by state); the engine-side peer keeps one
more (agreement rounds, events). ``TransferPeer.metrics()`` asks the worker for a
:class:`MetricsSnapshot` (plain data: it crosses the engine/worker pipe as JSON), merges the
peer's own, and returns it; a router or a node's ``/metrics`` serves
``snapshot.render(labels)``::

    worker registry ─ snapshot ─► pipe (JSON) ─► engine: merge(peer registry) ─► render()

Threading: every method of :class:`Registry` may be called from any thread (one lock). Gauges
registered with a callback (:meth:`Registry.gauge_fn`) are evaluated by the thread that takes
the snapshot, so in a worker they run on the control thread, which owns the state they read.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

Labels = tuple[tuple[str, str], ...]  # sorted (name, value) pairs
GaugeFn = Callable[[], Mapping[Labels, float]]

#: Seconds: a control-plane hop is ~0.1-1 ms here, a 512 MiB transfer ~0.4-3 s.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120)
#: GB/s of one transfer job: Mooncake TCP moves 0.04-1.6 GB/s here, RDMA up to ~50.
SPEED_BUCKETS = (0.01, 0.03, 0.1, 0.3, 0.5, 1, 1.5, 2, 5, 10, 25, 50)


class Kind(StrEnum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


def labels(**values: object) -> Labels:
    """A label set as the registry keys it (names sorted, values as text)."""
    return tuple(sorted((k, str(v)) for k, v in values.items()))


@dataclass(slots=True)
class Histogram:
    """Cumulative-at-render bucket counts (one per upper bound, then +Inf), sum and count."""

    counts: list[int]
    total: float = 0.0
    count: int = 0


@dataclass(slots=True)
class Family:
    """One metric: its kind, help text, buckets (histograms) and samples by label set."""

    name: str
    kind: Kind
    help: str
    buckets: tuple[float, ...] = ()
    samples: dict[Labels, Any] = field(default_factory=dict)  # float, or Histogram


class Registry:
    """Counters, gauges and histograms of one process (see the module docstring)."""

    def __init__(self, prefix: str = "tspd_pd_") -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._families: dict[str, Family] = {}
        self._gauge_fns: dict[str, GaugeFn] = {}

    # ---- declaring ----------------------------------------------------------------------

    def counter(self, name: str, help: str) -> str:
        """Declare a counter (``_total`` is the caller's to add); returns the full name."""
        return self._declare(name, Kind.COUNTER, help)

    def gauge(self, name: str, help: str) -> str:
        return self._declare(name, Kind.GAUGE, help)

    def histogram(self, name: str, help: str, buckets: Iterable[float]) -> str:
        bounds = tuple(sorted(float(b) for b in buckets))
        return self._declare(name, Kind.HISTOGRAM, help, bounds)

    def gauge_fn(self, name: str, help: str, fn: GaugeFn) -> str:
        """A gauge whose samples ``fn`` computes at snapshot time."""
        full = self._declare(name, Kind.GAUGE, help)
        self._gauge_fns[full] = fn
        return full

    def counter_fn(self, name: str, help: str, fn: GaugeFn) -> str:
        """A counter kept elsewhere (monotonic), whose samples ``fn`` reads at snapshot time."""
        full = self._declare(name, Kind.COUNTER, help)
        self._gauge_fns[full] = fn
        return full

    # ---- recording ----------------------------------------------------------------------

    def inc(self, name: str, amount: float = 1.0, at: Labels = ()) -> None:
        """Add ``amount`` (>= 0) to a counter."""
        if amount < 0:
            raise ValueError(f"counter {name} cannot decrease (got {amount})")
        with self._lock:
            fam = self._family(name, Kind.COUNTER)
            fam.samples[at] = fam.samples.get(at, 0.0) + amount

    def set(self, name: str, value: float, at: Labels = ()) -> None:
        with self._lock:
            self._family(name, Kind.GAUGE).samples[at] = float(value)

    def observe(self, name: str, value: float, at: Labels = ()) -> None:
        """Record one observation in a histogram."""
        with self._lock:
            fam = self._family(name, Kind.HISTOGRAM)
            h = fam.samples.get(at)
            if h is None:
                h = fam.samples[at] = Histogram([0] * (len(fam.buckets) + 1))
            h.counts[bisect_left(fam.buckets, value)] += 1
            h.total += value
            h.count += 1

    def snapshot(self) -> MetricsSnapshot:
        """Every family as plain data (callback gauges evaluated now, on this thread)."""
        computed = {name: dict(fn()) for name, fn in self._gauge_fns.items()}
        with self._lock:
            out: dict[str, dict[str, Any]] = {}
            for name, fam in self._families.items():
                samples = computed.get(name, fam.samples)
                out[name] = _family_data(fam, samples)
        return MetricsSnapshot(out)

    # ---- internals ----------------------------------------------------------------------

    def _declare(self, name: str, kind: Kind, help: str, buckets: tuple[float, ...] = ()) -> str:
        full = self.prefix + name
        with self._lock:
            known = self._families.get(full)
            if known is not None and (known.kind, known.buckets) != (kind, buckets):
                raise ValueError(f"metric {full} is already declared as a {known.kind}")
            if known is None:
                self._families[full] = Family(full, kind, help, buckets)
        return full

    def _family(self, name: str, kind: Kind) -> Family:
        fam = self._families.get(name)
        if fam is None or fam.kind is not kind:
            raise ValueError(f"{name} is not a declared {kind}")
        return fam


def _family_data(fam: Family, samples: Mapping[Labels, Any]) -> dict[str, Any]:
    rows = []
    for at, value in samples.items():
        if isinstance(value, Histogram):
            rows.append([list(map(list, at)), [list(value.counts), value.total, value.count]])
        else:
            rows.append([list(map(list, at)), float(value)])
    return {"kind": str(fam.kind), "help": fam.help, "buckets": list(fam.buckets), "rows": rows}


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    """Metrics at one moment, as plain JSON-able data: ``{name: {kind, help, buckets, rows}}``.

    A row is ``[labels, value]`` (counters, gauges) or ``[labels, [bucket counts, sum,
    count]]`` (histograms; counts per bucket, not cumulative, the last one for +Inf).
    """

    families: dict[str, dict[str, Any]]

    def merge(self, other: MetricsSnapshot) -> MetricsSnapshot:
        """Both snapshots' families (``other`` wins a name both have)."""
        return MetricsSnapshot({**self.families, **other.families})

    def value(self, name: str, **at: object) -> float:
        """One counter or gauge sample (0 if absent); a histogram gives its count."""
        fam = self.families.get(name)
        if fam is None:
            return 0.0
        want = [list(p) for p in labels(**at)]
        for row_labels, value in fam["rows"]:
            if row_labels == want:
                return float(value[2]) if fam["kind"] == Kind.HISTOGRAM else float(value)
        return 0.0

    def total(self, name: str) -> float:
        """A counter or gauge summed over every label set (a histogram: its total count)."""
        fam = self.families.get(name)
        if fam is None:
            return 0.0
        if fam["kind"] == Kind.HISTOGRAM:
            return float(sum(v[2] for _, v in fam["rows"]))
        return float(sum(v for _, v in fam["rows"]))

    def render(self, extra: Mapping[str, object] | None = None) -> str:
        """Prometheus text exposition (format 0.0.4); ``extra`` labels go on every sample."""
        base = [(k, str(v)) for k, v in sorted((extra or {}).items())]
        lines: list[str] = []
        for name in sorted(self.families):
            fam = self.families[name]
            lines.append(f"# HELP {name} {_escape_help(fam['help'])}")
            lines.append(f"# TYPE {name} {fam['kind']}")
            for row_labels, value in fam["rows"]:
                at = base + [(k, v) for k, v in row_labels]
                if fam["kind"] == Kind.HISTOGRAM:
                    lines += _histogram_lines(name, at, fam["buckets"], value)
                else:
                    lines.append(f"{name}{_render_labels(at)} {_number(value)}")
        return "\n".join(lines) + "\n"


def _histogram_lines(
    name: str, at: list[tuple[str, str]], buckets: list[float], value: list[Any]
) -> list[str]:
    counts, total, count = value
    out, running = [], 0
    for bound, n in zip([*buckets, math.inf], counts, strict=True):
        running += n
        le = "+Inf" if bound == math.inf else _number(bound)
        out.append(f"{name}_bucket{_render_labels([*at, ('le', le)])} {running}")
    out.append(f"{name}_sum{_render_labels(at)} {_number(total)}")
    out.append(f"{name}_count{_render_labels(at)} {count}")
    return out


def _render_labels(at: list[tuple[str, str]]) -> str:
    if not at:
        return ""
    inner = ",".join(f'{k}="{_escape_value(v)}"' for k, v in at)
    return "{" + inner + "}"


def _escape_value(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _number(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if math.isnan(v):
        return "NaN"
    return repr(float(v)) if v != int(v) else str(int(v))
