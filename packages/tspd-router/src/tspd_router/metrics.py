"""The router's metrics in the Prometheus text format (``GET /metrics``), all ``tspd_router_*``:

=============================  =========  =================================================
name                           type       labels / meaning
=============================  =========  =================================================
requests_total                 counter    endpoint, status: answered requests
errors_total                   counter    cause: failed requests (bad_request, no_prefill_node,
                                          transfer_failed, prefill_failed, decode_failed,
                                          prefill_node_down, decode_node_down, timeout,
                                          client_gone, ...)
ttft_seconds                   histogram  time to first token (request received -> first token)
tpot_seconds                   histogram  time per output token after the first
e2e_seconds                    histogram  request received -> last token
prompt_tokens_total            counter    prompt tokens of completed requests
completion_tokens_total        counter    tokens generated for completed requests
in_flight                      gauge      node, role: requests in flight on each node
node_requests_total            counter    node, role: requests sent to each node (its picks)
node_healthy                   gauge      node, role: 1 while the node takes requests
busy_refusals_total            counter    role: attempts a node refused as busy (at capacity;
                                          each tried on another node or answered 429)
=============================  =========  =================================================

Beside them ``process_start_time_seconds`` (tspd_serving.process_metrics).

Updated and rendered on the router's event loop only (no locking).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence

from tspd_router.nodes import NodePool

PREFIX = "tspd_router_"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    """Cumulative buckets, sum and count (Prometheus semantics)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        full = PREFIX + name
        out = [f"# HELP {full} {help_text}", f"# TYPE {full} histogram"]
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            le = "+Inf" if bound == float("inf") else f"{bound:g}"
            out.append(f'{full}_bucket{{le="{le}"}} {running}')
        out += [f"{full}_sum {self.sum:.6f}", f"{full}_count {self.count}"]
        return out


class RouterMetrics:
    """Counters and histograms; see the module docstring for the families."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.errors: Counter[str] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.busy: Counter[str] = Counter()

    def answered(self, endpoint: str, status: int) -> None:
        self.requests[endpoint, status] += 1

    def failed(self, cause: str) -> None:
        self.errors[cause] += 1

    def refused_busy(self, role: str) -> None:
        """A node of ``role`` refused an attempt for being at capacity."""
        self.busy[role] += 1

    def completed(self, prompt: int, generated: int, times: Sequence[float]) -> None:
        """One choice finished: ``times`` = (received, first token, last token) if any token."""
        self.prompt_tokens += prompt
        self.completion_tokens += generated
        if len(times) == 3 and generated:
            received, first, last = times
            self.ttft.observe(first - received)
            self.e2e.observe(last - received)
            if generated > 1:
                self.tpot.observe((last - first) / (generated - 1))

    def render(self, pool: NodePool) -> str:
        out: list[str] = []
        _family(out, "requests_total", "counter", "Answered requests.")
        for (endpoint, status), n in sorted(self.requests.items()):
            out.append(_sample("requests_total", n, endpoint=endpoint, status=str(status)))
        _family(out, "errors_total", "counter", "Failed requests by cause.")
        for cause, n in sorted(self.errors.items()):
            out.append(_sample("errors_total", n, cause=cause))
        out += self.ttft.render("ttft_seconds", "Time to first token.")
        out += self.tpot.render("tpot_seconds", "Time per output token after the first.")
        out += self.e2e.render("e2e_seconds", "Request received to last token.")
        _family(out, "prompt_tokens_total", "counter", "Prompt tokens of completed requests.")
        out.append(_sample("prompt_tokens_total", self.prompt_tokens))
        _family(out, "completion_tokens_total", "counter", "Generated tokens.")
        out.append(_sample("completion_tokens_total", self.completion_tokens))
        _family(out, "in_flight", "gauge", "Requests in flight per node.")
        for node in pool.all():
            labels = {"node": node.url, "role": node.role.value}
            out.append(_sample("in_flight", node.in_flight, **labels))
        _family(out, "node_requests_total", "counter", "Requests sent to each node.")
        for node in pool.all():
            labels = {"node": node.url, "role": node.role.value}
            out.append(_sample("node_requests_total", node.sent, **labels))
        _family(out, "node_healthy", "gauge", "1 while the node takes requests.")
        for node in pool.all():
            labels = {"node": node.url, "role": node.role.value}
            out.append(_sample("node_healthy", int(node.healthy), **labels))
        _family(out, "busy_refusals_total", "counter", "Attempts a node refused as busy.")
        for role, n in sorted(self.busy.items()):
            out.append(_sample("busy_refusals_total", n, role=role))
        return "\n".join(out) + "\n"


def _family(out: list[str], name: str, kind: str, help_text: str) -> None:
    out += [f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"]


def _sample(name: str, value: float, **labels: str) -> str:
    if not labels:
        return f"{PREFIX}{name} {value:g}"
    text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{PREFIX}{name}{{{text}}} {value:g}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
