"""The engine counters of a node's replicas in the Prometheus text format (``tspd_node_*``).

``GET /stats`` gives each replica's counters as JSON under their plain keys (what the router's
health checks and the demo read); ``GET /metrics`` renders the same values here. Monotonic
counts are Prometheus counters, named with ``_total`` as its naming rules ask (``preemptions``
→ ``tspd_node_preemptions_total``); levels (pool, queues, rooms tracked) are gauges under
their own key. A key no table below knows (a hook's new counter) is rendered as a gauge, so a
new counter shows up at once and gets its proper type when it is added here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

#: Monotonic counters: stats key -> (exposition name without the prefix, help).
COUNTERS: dict[str, tuple[str, str]] = {
    "preemptions": ("preemptions_total", "requests preempted (recomputed) after a page shortage"),
    "discarded_steps": ("discarded_steps_total", "fed decode steps launched past a stop"),
    "forward_tokens": ("forward_tokens_total", "tokens pushed through the model"),
    **{
        f"{kind}_{key}": (f"{kind}_{key}_total", f"{text} ({what})")
        for kind, what in (
            ("prefill", "prefill chunks only"),
            ("decode", "one decode step only"),
            ("mixed", "prefill chunks and a decode step"),
        )
        for key, text in (
            ("rounds", "scheduler rounds that ran a forward"),
            ("round_seconds", "seconds of those rounds, intake to outputs sent"),
        )
    },
    "pd_transfers_ok": ("pd_transfers_ok_total", "PD transfers that succeeded"),
    "pd_transfers_failed": ("pd_transfers_failed_total", "PD transfers that failed"),
    "pd_transfer_seconds_sum": (
        "pd_transfer_seconds_total",
        "seconds of succeeded transfers (P: hand-over to Succeeded; D: register to KV in)",
    ),
    "pd_kv_pages_in": ("pd_kv_pages_in_total", "D: KV pages received (past D's prefix hit)"),
    "pd_kv_bytes_in": ("pd_kv_bytes_in_total", "D: KV bytes received (whole replica's pages)"),
}

#: Levels: stats key -> help.
GAUGES: dict[str, str] = {
    "total_pages": "usable KV pages per rank",
    "initial_free_pages": "free KV pages when the replica started",
    "free_pages": "KV pages on the free list",
    "reclaimable_pages": "free KV pages plus cached pages no request uses",
    "waiting": "requests queued (blocked ones included)",
    "blocked": "PD prefills queued until their decode side is ready",
    "running": "requests admitted",
    "held": "requests whose pages are held until their transfer ends",
    "pd_peer_ok": "1 while the replica's PD transfer worker works",
    "pd_rooms_tracked": "PD rooms the replica's peer tracks",
    "pd_rooms_published": "D: rooms whose manifest went to P and that wait for KV",
}

PREFIX = "tspd_node_"


def render(role: str, replicas: Sequence[Mapping[str, float]]) -> str:
    """The replicas' counters as one exposition, labelled ``role`` and ``replica``; each
    family declared once (HELP and TYPE), families in name order."""
    families: dict[str, tuple[str, str, str]] = {}  # exposition name -> (key, type, help)
    for key in {k for values in replicas for k in values}:
        if key in COUNTERS:
            name, text = COUNTERS[key]
            families[PREFIX + name] = (key, "counter", text)
        else:
            families[PREFIX + key] = (key, "gauge", GAUGES.get(key, key.replace("_", " ")))
    lines: list[str] = []
    for name in sorted(families):
        key, kind, text = families[name]
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for i, values in enumerate(replicas):
            if key in values:
                lines.append(f'{name}{{role="{role}",replica="{i}"}} {number(values[key])}')
    return "\n".join(lines) + "\n" if lines else ""


def number(value: float) -> str:
    """A sample value exactly: an integral value as an integer (``96``, ``1234567``), any other
    as the shortest text that reads back to the same float (``:g``'s six digits lost counts
    past a million and the microseconds of a seconds counter)."""
    v = float(value)
    if v != v or v in (float("inf"), float("-inf")):
        return "NaN" if v != v else ("+Inf" if v > 0 else "-Inf")  # the exposition's spelling
    return str(int(v)) if v.is_integer() and abs(v) < 2**53 else repr(v)
