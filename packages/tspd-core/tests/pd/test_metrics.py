"""The metrics registry and its Prometheus text: exact output, merging, refusals."""

from __future__ import annotations

import json
import threading

import pytest

from tspd_core.pd.metrics.registry import MetricsSnapshot, Registry, labels


def _registry() -> tuple[Registry, str, str, str]:
    r = Registry()
    c = r.counter("room_failures_total", "Rooms failed, by cause")
    g = r.gauge("queue", "Jobs queued")
    h = r.histogram("transfer_seconds", "Time of one job", [0.01, 0.1, 1])
    return r, c, g, h


def test_prometheus_text_is_exact() -> None:
    r, c, g, h = _registry()
    r.inc(c, at=labels(cause="write"))
    r.inc(c, 2, at=labels(cause="timeout"))
    r.inc(c, at=labels(cause="write"))
    r.set(g, 3)
    for v in (0.005, 0.01, 0.5, 7.0):
        r.observe(h, v)
    r.gauge_fn("rooms", "Rooms by state", lambda: {labels(state="success"): 4.0})
    text = r.snapshot().render({"role": "prefill", "rank": 1})
    assert text == (
        "# HELP tspd_pd_queue Jobs queued\n"
        "# TYPE tspd_pd_queue gauge\n"
        'tspd_pd_queue{rank="1",role="prefill"} 3\n'
        "# HELP tspd_pd_room_failures_total Rooms failed, by cause\n"
        "# TYPE tspd_pd_room_failures_total counter\n"
        'tspd_pd_room_failures_total{rank="1",role="prefill",cause="write"} 2\n'
        'tspd_pd_room_failures_total{rank="1",role="prefill",cause="timeout"} 2\n'
        "# HELP tspd_pd_rooms Rooms by state\n"
        "# TYPE tspd_pd_rooms gauge\n"
        'tspd_pd_rooms{rank="1",role="prefill",state="success"} 4\n'
        "# HELP tspd_pd_transfer_seconds Time of one job\n"
        "# TYPE tspd_pd_transfer_seconds histogram\n"
        'tspd_pd_transfer_seconds_bucket{rank="1",role="prefill",le="0.01"} 2\n'
        'tspd_pd_transfer_seconds_bucket{rank="1",role="prefill",le="0.1"} 2\n'
        'tspd_pd_transfer_seconds_bucket{rank="1",role="prefill",le="1"} 3\n'
        'tspd_pd_transfer_seconds_bucket{rank="1",role="prefill",le="+Inf"} 4\n'
        'tspd_pd_transfer_seconds_sum{rank="1",role="prefill"} 7.515\n'
        'tspd_pd_transfer_seconds_count{rank="1",role="prefill"} 4\n'
    )


def test_snapshot_is_plain_json_and_reads_back() -> None:
    r, c, g, h = _registry()
    r.inc(c, 5, at=labels(cause="abort"))
    r.observe(h, 0.2)
    snap = MetricsSnapshot(json.loads(json.dumps(r.snapshot().families)))
    assert snap.value(c, cause="abort") == 5.0
    assert snap.value(c, cause="write") == 0.0
    assert snap.value(h) == 1.0  # a histogram's count
    assert snap.total(c) == 5.0
    assert snap.value("tspd_pd_nothing") == 0.0
    other = Registry()
    other.set(other.gauge("worker_up", "up"), 1)
    merged = snap.merge(other.snapshot())
    assert sorted(merged.families) == sorted([c, g, h, "tspd_pd_worker_up"])


def test_label_values_are_escaped() -> None:
    r = Registry()
    c = r.counter("x_total", "a\nb")
    r.inc(c, at=labels(reason='say "hi"\\'))
    text = r.snapshot().render()
    assert "# HELP tspd_pd_x_total a\\nb\n" in text
    assert 'tspd_pd_x_total{reason="say \\"hi\\"\\\\"} 1\n' in text


def test_refusals() -> None:
    r, c, g, _ = _registry()
    with pytest.raises(ValueError, match="cannot decrease"):
        r.inc(c, -1)
    with pytest.raises(ValueError, match="is not a declared counter"):
        r.inc(g)
    with pytest.raises(ValueError, match="already declared as a gauge"):
        r.counter("queue", "again")
    assert r.counter("room_failures_total", "same kind: the same family") == c


def test_concurrent_increments_are_exact() -> None:
    r, c, _, h = _registry()

    def work() -> None:
        for _ in range(2000):
            r.inc(c, at=labels(cause="write"))
            r.observe(h, 0.05)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = r.snapshot()
    assert snap.value(c, cause="write") == 8000.0
    assert snap.value(h) == 8000.0
