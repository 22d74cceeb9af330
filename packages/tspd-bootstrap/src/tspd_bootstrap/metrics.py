"""Counters of one bootstrap server, rendered in the Prometheus text format (``GET /metrics``).

Updated and rendered on the server's event loop only (no locking). Families, all prefixed
``tspd_bootstrap_``:

=================================  =======  ==============================================
name                               type     labels / meaning
=================================  =======  ==============================================
registrations_total                counter  role: accepted ``PUT /route``
reregistrations_total              counter  accepted PUTs of an already registered rank
                                            (renewals of a lease included)
replacements_total                 counter  how (lease_lapsed, credential): a rank moved to
                                            another address
redeployments_total                counter  a lone rank redefined sizes or layout
deregistrations_total              counter  ranks removed by ``DELETE /ranks[/<rank>]``
lookups_total                      counter  kind (parallel_info, rank), result (hit, miss)
errors_total                       counter  status, reason: every refused request (409
                                            rank_held: a refused replacement; 401: no or a
                                            bad credential seal)
registered_ranks                   gauge    ranks stored now
expected_ranks                     gauge    world size of the deployment (0 if none)
deployment_complete                gauge    1 once every expected rank is registered
start_time_seconds                 gauge    Unix time the server started
info                               gauge    kind, version (always 1)
=================================  =======  ==============================================
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tspd_bootstrap.model import Role, ServerKind

PREFIX = "tspd_bootstrap_"
_LOOKUP_KINDS = ("parallel_info", "rank")
_LOOKUP_RESULTS = ("hit", "miss")
_REPLACEMENTS = ("lease_lapsed", "credential")
_ROLES = {ServerKind.KV: (Role.PREFILL,), ServerKind.EMBEDDING: (Role.PREFILL, Role.ENCODE)}


@dataclass(frozen=True, slots=True)
class Gauges:
    """Registry state sampled at render time."""

    registered: int
    expected: int
    complete: bool


class Metrics:
    """The counters; see the module docstring for the exported families."""

    def __init__(self, kind: ServerKind, started: float, version: str) -> None:
        self.kind = kind
        self.started = started
        self.version = version
        self.registrations: Counter[Role] = Counter()
        self.reregistrations = 0
        self.redeployments = 0
        self.deregistrations = 0
        self.lookups: Counter[tuple[str, str]] = Counter()
        self.errors: Counter[tuple[int, str]] = Counter()
        self.replacements: Counter[str] = Counter()

    def registered(self, role: Role, *, again: bool, redeployed: bool) -> None:
        self.registrations[role] += 1
        self.reregistrations += again
        self.redeployments += redeployed

    def replaced(self, how: str) -> None:
        self.replacements[how] += 1

    def looked_up(self, kind: str, hit: bool) -> None:
        self.lookups[kind, "hit" if hit else "miss"] += 1

    def refused(self, status: int, reason: str) -> None:
        self.errors[status, reason] += 1

    def render(self, gauges: Gauges) -> str:
        """The whole exposition, ending with a newline."""
        out: list[str] = []
        self._render_counters(out)
        _single(out, "registered_ranks", "gauge", "Ranks registered now.", gauges.registered)
        _single(out, "expected_ranks", "gauge", "World size of the deployment.", gauges.expected)
        complete = int(gauges.complete)
        _single(out, "deployment_complete", "gauge", "1 once every rank registered.", complete)
        _single(out, "start_time_seconds", "gauge", "Unix time the server started.", self.started)
        _family(out, "info", "gauge", "Server kind and version.")
        out.append(_sample("info", 1, kind=self.kind.value, version=self.version))
        return "\n".join(out) + "\n"

    def _render_counters(self, out: list[str]) -> None:
        _family(out, "registrations_total", "counter", "Accepted PUT /route, by role.")
        out.extend(
            _sample("registrations_total", self.registrations[role], role=role.value)
            for role in _ROLES[self.kind]
        )
        again = self.reregistrations
        _single(out, "reregistrations_total", "counter", "PUTs of a registered rank.", again)
        _family(out, "replacements_total", "counter", "Ranks moved to another address, by how.")
        out.extend(
            _sample("replacements_total", self.replacements[how], how=how) for how in _REPLACEMENTS
        )
        redeploys = self.redeployments
        _single(out, "redeployments_total", "counter", "Lone-rank redeployments.", redeploys)
        gone = self.deregistrations
        _single(out, "deregistrations_total", "counter", "Ranks removed by an operator.", gone)
        _family(out, "lookups_total", "counter", "GET /route answers, by kind and result.")
        out.extend(
            _sample("lookups_total", self.lookups[kind, result], kind=kind, result=result)
            for kind in _LOOKUP_KINDS
            for result in _LOOKUP_RESULTS
        )
        _family(out, "errors_total", "counter", "Refused requests, by status and reason.")
        out.extend(
            _sample("errors_total", value, status=str(status), reason=reason)
            for (status, reason), value in sorted(self.errors.items())
        )


def _family(out: list[str], name: str, kind: str, help_text: str) -> None:
    out.append(f"# HELP {PREFIX}{name} {help_text}")
    out.append(f"# TYPE {PREFIX}{name} {kind}")


def _single(out: list[str], name: str, kind: str, help_text: str, value: float) -> None:
    _family(out, name, kind, help_text)
    out.append(_sample(name, value))


def _sample(name: str, value: float, **labels: str) -> str:
    text = repr(value) if isinstance(value, float) else str(value)
    if not labels:
        return f"{PREFIX}{name} {text}"
    shown = ",".join(f'{key}="{_escape(val)}"' for key, val in labels.items())
    return f"{PREFIX}{name}{{{shown}}} {text}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
