"""Routing policies: which P instance and which D instance serve a request.

The router picks an *instance* on each side; the request's room then picks the DP group inside
it (``room % dp``, wire.md §6.4), so the candidate engine of instance i is
``instances[i][room % dp]``.

* ``round_robin``  — cycle through P instances and, independently, D instances.
* ``least_load``   — the candidate owing the least work. P: prompt tokens routed there whose KV
                     has not drained to D yet — still queued, prefilling, or prefilled with the
                     transfer in flight and the pages held; D: requests routed there and not
                     finished (queued for pages, awaiting KV, decoding).
* ``prefix_aware`` — longest prefix hit in the candidate engine's prefix store (P for compute,
                     D for transfer), ties by load; falls back to least load when the cluster
                     is imbalanced (SGLang router's cache-aware rule: the most loaded engine
                     exceeds the least loaded by more than ``balance_abs`` *and* by a factor
                     ``balance_rel``) or when the best hit covers less than ``cache_threshold``
                     of the prompt (SGLang's cache threshold: a prefix every request shares,
                     such as a system prompt, must not pin all traffic to the few engines that
                     happened to cache it first).

**Ties are broken round robin**: each side keeps a cursor just past its last pick, and among
equally good candidates the first at or after the cursor (cyclically) wins. On an idle cluster
(every load zero, no prefix hits) the least-load and prefix-aware policies therefore spread
requests exactly like round robin instead of piling them onto instance 0, and since the cursor
is plain state driven by the (deterministic) event order, seeded runs stay bit-for-bit
repeatable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tspd_sim.errors import SpecError
from tspd_sim.sim.request import SimRequest

if TYPE_CHECKING:
    from tspd_sim.sim.kv import EngineKv

POLICIES = ("round_robin", "least_load", "prefix_aware")


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    """The routing policy, and the prefix-aware policy's imbalance guards and cache threshold."""

    policy: str = "prefix_aware"
    #: P imbalance guard: absolute gap in owed prompt tokens (see ``least_load``), and ratio.
    p_balance_abs: int = 65536
    p_balance_rel: float = 1.5
    #: D imbalance guard: absolute gap in routed requests, and ratio.
    d_balance_abs: int = 32
    d_balance_rel: float = 1.5
    #: Least share of the prompt the best prefix hit must cover to route by it (else by load).
    cache_threshold: float = 0.5

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise SpecError(f"unknown routing policy {self.policy!r}; choose one of {POLICIES}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise SpecError(f"cache_threshold {self.cache_threshold}: must be in [0, 1]")


class Routable(Protocol):
    """What the router reads of an engine: its prefix store and the work it still owes."""

    kv: EngineKv

    def route_load(self) -> float: ...


class SideRouter:
    """Routes one side (P or D) over its instances; each instance is a list of DP engines."""

    def __init__(
        self,
        instances: Sequence[Sequence[Routable]],
        policy: str,
        balance_abs: float,
        balance_rel: float,
        cache_threshold: float = 0.5,
    ) -> None:
        self.instances = instances
        self.policy = policy
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.cache_threshold = cache_threshold
        #: Tie-break cursor: the instance just after the last pick.
        self._next = 0

    def pick(self, req: SimRequest) -> Routable:
        """The engine that serves ``req`` on this side. Called once per request, in arrival
        order, on the simulation's thread; it advances the tie-break cursor."""
        cands = [inst[req.room % len(inst)] for inst in self.instances]
        n = len(cands)
        # Candidates in tie-break order: from the cursor on, cyclically. ``min``/``max`` keep
        # the first of equal keys, so the order is the tie-break.
        order = [(self._next + k) % n for k in range(n)]
        chosen = self._choose(req, cands, order)
        self._next = (chosen + 1) % n
        return cands[chosen]

    def _choose(self, req: SimRequest, cands: list[Routable], order: list[int]) -> int:
        if self.policy == "round_robin":
            return order[0]
        loads = [c.route_load() for c in cands]
        least = min(order, key=loads.__getitem__)
        if self.policy == "least_load" or len(cands) == 1:
            return least
        hi, lo = max(loads), loads[least]
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return least
        hits = [c.kv.match_tokens(req.key_list, req.input_len) for c in cands]
        best = max(order, key=lambda i: (hits[i], -loads[i]))
        if hits[best] < self.cache_threshold * req.input_len:
            return least
        return best
