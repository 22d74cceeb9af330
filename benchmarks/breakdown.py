"""Where a request's time goes: per-stage figures from ``tspd_core.trace`` stamps.

A stage runs from one stamp of a request to another; a stamp is named by a *point*
``"<process label prefix>|<what>[:<extra>]"`` (``"decode-worker|dw.cmd:PublishManifest"``:
the first ``dw.cmd`` stamp with extra ``PublishManifest`` of a process whose label starts
with ``decode-worker``). A request's stamps are those keyed by its request id plus those of
its room (joined through the engine-side peer's ``<role>.register`` stamps, whose extra is
the request id). Each stage reports the median and p90 over the requests that have both
points (milliseconds), and the stages' medians add up along a chain.

Used by ``bench_transfer --breakdown`` (the one-page round trip) and ``bench_e2e
--breakdown`` (TTFT of PD and colocated requests).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from tspd_core.trace import Stamp

#: A stage: its name, where it starts and where it ends (points, see the module docstring).
Stage = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class StageFigures:
    name: str
    count: int
    p50_ms: float
    p90_ms: float


def by_request(stamps: Iterable[Stamp]) -> dict[str, list[Stamp]]:
    """Each request id's stamps, its room's included, oldest first."""
    stamps = list(stamps)
    rooms: dict[str, set[str]] = defaultdict(set)  # room key -> request ids
    for s in stamps:
        if s.key.startswith("room:") and s.what.endswith(".register") and s.extra:
            rooms[s.key].add(s.extra)
    out: dict[str, list[Stamp]] = defaultdict(list)
    for s in stamps:
        for rid in rooms.get(s.key, ()) if s.key.startswith("room:") else (s.key,):
            out[rid].append(s)
    for items in out.values():
        items.sort(key=lambda s: s.t_ns)
    return dict(out)


def point_time(stamps: Sequence[Stamp], point: str) -> int | None:
    """The first stamp of ``stamps`` matching ``point`` (ns), or None."""
    label, _, rest = point.partition("|")
    what, _, extra = rest.partition(":")
    for s in stamps:
        if s.what == what and s.label.startswith(label) and (not extra or s.extra == extra):
            return s.t_ns
    return None


def figures(requests: Iterable[Sequence[Stamp]], stages: Sequence[Stage]) -> list[StageFigures]:
    """Median and p90 of each stage over the requests that have both of its points."""
    spans: list[list[float]] = [[] for _ in stages]
    for stamps in requests:
        for i, (_, start, end) in enumerate(stages):
            a, b = point_time(stamps, start), point_time(stamps, end)
            if a is not None and b is not None:
                spans[i].append((b - a) / 1e6)
    out = []
    for (name, _, _), values in zip(stages, spans, strict=True):
        p50 = float(np.percentile(values, 50)) if values else float("nan")
        p90 = float(np.percentile(values, 90)) if values else float("nan")
        out.append(StageFigures(name, len(values), p50, p90))
    return out


def chain(points: Sequence[tuple[str, str]]) -> list[Stage]:
    """Stages between consecutive points: ``[(name, point), ...]`` where each name says what
    happened *up to* its point from the previous one (the first entry only starts)."""
    return [(points[i][0], points[i - 1][1], points[i][1]) for i in range(1, len(points))]


def client_stamps(rid: str, sent_s: float, first_s: float) -> list[Stamp]:
    """A client's send and first text (``perf_counter`` seconds) as stamps of ``rid``."""
    return [
        Stamp(int(sent_s * 1e9), 0, "client", "", rid, "client.sent"),
        Stamp(int(first_s * 1e9), 0, "client", "", rid, "client.first"),
    ]
