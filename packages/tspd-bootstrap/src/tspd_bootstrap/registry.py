"""The registry of data-source ranks behind one bootstrap server. Pure: no I/O, no clock.

One *deployment* is the set of ranks of one instance: the first accepted registration fixes its
``world_size``, ``dp_size`` and (KV server) canonical cache layout; every other rank must agree.

::

    engine_rank ─► [dp_group = engine_rank // tp_per_dp][tp_rank = engine_rank % tp_per_dp]

    world 4, dp 2:   dp 0: tp 0 (rank 0), tp 1 (rank 1)
                     dp 1: tp 0 (rank 2), tp 1 (rank 3)

Rules (the server maps errors to HTTP statuses through :class:`RegistrationError`):

* A rank re-registering from its own address (same ``engine_rank``, ``rank_ip``, ``rank_port``)
  renews its entry; it must still agree with the deployment while any *other* rank is registered
  (else 409, registry unchanged).
* A registration from *another* address replaces a stored rank only when its holder is gone: a
  rank that announced :data:`LEASE_EXTENSION` (a tspd P rank, which renews every few seconds)
  once ``lease_s`` passed since its last registration; a rank that did not (a TokenSpeed rank
  PUTs once) never lapses. Otherwise it is a 409 ``rank_held``, unless the caller vouches for
  it (``trusted``: sealed with the cluster credential). An operator removes a rank with
  :meth:`Registry.deregister` (``DELETE /ranks/<rank>``).
* When no other rank is registered, a registration defines the deployment afresh, so a lone
  restarted rank may change sizes or layout. A full redeploy of a multi-rank instance goes through
  :meth:`Registry.reset` (``DELETE /ranks``) or one :meth:`Registry.deregister` per rank.
* A rank look-up answers once the DP group it asks for is complete (every TP rank of that group
  registered), whatever the other groups are doing: a decode rank needs exactly its group.
  Until then it returns ``None``, which the server turns into wire.md §3.3's 500 ("not yet").

Threading: a Registry is owned by one thread (the server's event loop) and is not locked.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import Enum

from tspd_bootstrap.errors import RegistrationError
from tspd_bootstrap.model import (
    DeploymentView,
    ParallelInfo,
    RankAddress,
    RankEntry,
    Registration,
    ServerKind,
)


class Outcome(Enum):
    """What an accepted registration did."""

    NEW = "new"  # first registration of this engine rank
    REREGISTERED = "reregistered"  # the rank was there at this address: renewed
    REPLACED = "replaced"  # the rank was there at another address, whose holder is gone
    REDEPLOYED = "redeployed"  # the lone registered rank changed sizes or layout


#: Seconds a leased rank holds its address after its last registration (tspd P ranks renew
#: every 5 s: four renewals may fail before another address can take the rank).
DEFAULT_LEASE_S = 20.0


@dataclass(frozen=True, slots=True)
class _Deployment:
    world_size: int
    dp_size: int
    layout: str | None

    @property
    def tp_per_dp(self) -> int:
        return self.world_size // self.dp_size


class Registry:
    """Registered ranks of one deployment, by DP group and TP rank. See the module docstring."""

    def __init__(self, kind: ServerKind, lease_s: float = DEFAULT_LEASE_S) -> None:
        if lease_s <= 0:
            raise ValueError(f"the lease must be > 0 s, got {lease_s}")
        self.kind = kind
        self.lease_s = lease_s
        self._deployment: _Deployment | None = None
        self._ranks: dict[int, RankEntry] = {}

    @property
    def registered(self) -> int:
        return len(self._ranks)

    @property
    def expected(self) -> int:
        """Ranks the deployment needs (0 before the first registration)."""
        return 0 if self._deployment is None else self._deployment.world_size

    @property
    def complete(self) -> bool:
        return self._deployment is not None and len(self._ranks) == self._deployment.world_size

    def register(self, reg: Registration, now: float, *, trusted: bool = False) -> Outcome:
        """Store ``reg`` (validated by the caller) or raise 409 without changing anything.

        ``trusted``: the registration is sealed with the cluster credential, so it may replace
        a rank whose holder is still there (a restarted rank comes back at once).
        """
        if (reg.cache_layout is None) != (self.kind is ServerKind.EMBEDDING):
            # The wire parser enforces this; a direct caller gets the same answer.
            raise RegistrationError(
                400, "bad_field", f"a {self.kind} server takes cache_layout iff it is a KV server"
            )
        held = self.holder(reg, now)
        if held is not None and not trusted:
            raise RegistrationError(409, "rank_held", self._held(reg, held))
        offered = _Deployment(reg.world_size, reg.dp_size, reg.cache_layout)
        others = sorted(r for r in self._ranks if r != reg.engine_rank)
        outcome = self._outcome(reg)
        if others:
            assert self._deployment is not None, "ranks stored without a deployment"
            self._check_agrees(reg, offered, self._deployment, others)
        else:
            if outcome is not Outcome.NEW and offered != self._deployment:
                outcome = Outcome.REDEPLOYED
            self._deployment = offered
        self._store(reg, now)
        return outcome

    def entry(self, engine_rank: int) -> RankEntry | None:
        return self._ranks.get(engine_rank)

    def holder(self, reg: Registration, now: float) -> RankEntry | None:
        """The live entry ``reg`` would replace: its engine rank stored at another address
        whose lease has not lapsed (a rank without a lease never lapses); else ``None``."""
        entry = self._ranks.get(reg.engine_rank)
        if entry is None or (entry.rank_ip, entry.rank_port) == (reg.rank_ip, reg.rank_port):
            return None
        if entry.leased and now - entry.last_registered >= self.lease_s:
            return None
        return entry

    def lease_left(self, entry: RankEntry, now: float) -> float | None:
        """Seconds until ``entry``'s lease lapses (``None``: it has no lease)."""
        if not entry.leased:
            return None
        return max(0.0, entry.last_registered + self.lease_s - now)

    def parallel_info(self) -> ParallelInfo | None:
        """Sizes (and KV layout) of the deployment; ``None`` before the first registration."""
        dep = self._deployment
        if dep is None:
            return None
        return ParallelInfo(dep.world_size, dep.dp_size, dep.layout)

    def lookup(self, tp_rank: int, dp_group: int) -> RankAddress | None:
        """Address of TP rank ``tp_rank`` in DP group ``dp_group``.

        ``None`` while that DP group is incomplete or no rank registered yet (the caller
        retries or fails the room); raises a 400 :class:`RegistrationError` for negative or
        out-of-range indices.
        """
        if tp_rank < 0 or dp_group < 0:
            raise RegistrationError(
                400,
                "out_of_range",
                f"engine_rank {tp_rank} and target_dp_group {dp_group} must both be >= 0 "
                "(or both -1 for the parallel info)",
            )
        dep = self._deployment
        if dep is None:
            return None
        if tp_rank >= dep.tp_per_dp or dp_group >= dep.dp_size:
            raise RegistrationError(
                400,
                "out_of_range",
                f"engine_rank {tp_rank} / target_dp_group {dp_group} out of range: the deployment "
                f"has {dep.dp_size} DP group(s) of {dep.tp_per_dp} TP rank(s)",
            )
        if self.group_missing(dp_group):
            return None
        return self._ranks[dp_group * dep.tp_per_dp + tp_rank].address

    def group_missing(self, dp_group: int) -> tuple[int, ...]:
        """Engine ranks of ``dp_group`` not registered yet (all of them before a deployment)."""
        dep = self._deployment
        if dep is None:
            return ()
        first = dp_group * dep.tp_per_dp
        return tuple(r for r in range(first, first + dep.tp_per_dp) if r not in self._ranks)

    def snapshot(self) -> DeploymentView:
        dep = self._deployment
        ranks = tuple(self._ranks[r] for r in sorted(self._ranks))
        if dep is None:
            return DeploymentView(self.kind, None, None, None, None, ranks, ())
        missing = tuple(r for r in range(dep.world_size) if r not in self._ranks)
        layout = dep.layout.encode() if dep.layout is not None else None
        return DeploymentView(
            kind=self.kind,
            world_size=dep.world_size,
            dp_size=dep.dp_size,
            layout_bytes=None if layout is None else len(layout),
            layout_sha256=None if layout is None else hashlib.sha256(layout).hexdigest(),
            ranks=ranks,
            missing=missing,
        )

    def deregister(self, engine_rank: int) -> RankEntry | None:
        """Forget one rank; the deployment itself is forgotten with its last rank."""
        entry = self._ranks.pop(engine_rank, None)
        if not self._ranks:
            self._deployment = None
        return entry

    def reset(self) -> int:
        """Forget every rank and the deployment (operator redeploy); returns how many ranks."""
        count = len(self._ranks)
        self._ranks.clear()
        self._deployment = None
        return count

    def _outcome(self, reg: Registration) -> Outcome:
        entry = self._ranks.get(reg.engine_rank)
        if entry is None:
            return Outcome.NEW
        if (entry.rank_ip, entry.rank_port) == (reg.rank_ip, reg.rank_port):
            return Outcome.REREGISTERED
        return Outcome.REPLACED

    def _held(self, reg: Registration, held: RankEntry) -> str:
        r = reg.engine_rank
        if held.leased:
            why = f"which renews its lease (it lapses {self.lease_s:g} s after the last renewal)"
            ways = "once that lease lapses, after"
        else:
            why = "which registered without a lease (a rank that registers once keeps its address)"
            ways = "after"
        return (
            f"engine_rank {r} is registered at {held.rank_ip}:{held.rank_port}, {why}; "
            f"{reg.rank_ip}:{reg.rank_port} may take it over only {ways} an operator's "
            f"DELETE /ranks/{r}, or with the cluster credential"
        )

    def _store(self, reg: Registration, now: float) -> None:
        old = self._ranks.get(reg.engine_rank)
        self._ranks[reg.engine_rank] = RankEntry(
            engine_rank=reg.engine_rank,
            dp_group=reg.dp_group,
            tp_rank=reg.tp_rank,
            role=reg.role,
            rank_ip=reg.rank_ip,
            rank_port=reg.rank_port,
            registrations=1 if old is None else old.registrations + 1,
            first_registered=now if old is None else old.first_registered,
            last_registered=now,
            extensions=reg.extensions,
        )

    @staticmethod
    def _check_agrees(
        reg: Registration, offered: _Deployment, dep: _Deployment, others: list[int]
    ) -> None:
        holders = _rank_list(others)
        hint = "restart the stale ranks together, or DELETE /ranks to redeploy"
        if (offered.world_size, offered.dp_size) != (dep.world_size, dep.dp_size):
            raise RegistrationError(
                409,
                "deployment_conflict",
                f"engine_rank {reg.engine_rank} registers world_size {offered.world_size}, "
                f"dp_size {offered.dp_size}, but {holders} registered world_size "
                f"{dep.world_size}, dp_size {dep.dp_size}; {hint}",
            )
        if offered.layout != dep.layout:
            assert offered.layout is not None, "KV registrations carry a layout"
            assert dep.layout is not None, "KV deployments carry a layout"
            raise RegistrationError(
                409,
                "layout_conflict",
                f"cache_layout of engine_rank {reg.engine_rank} differs from the one {holders} "
                f"registered ({first_difference(offered.layout, dep.layout)}); every rank of a "
                f"deployment must register the same canonical layout; {hint}",
            )


def _rank_list(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    more = f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    return f"engine_rank {shown}{more}"


def first_difference(new: str, old: str, context: int = 24) -> str:
    """Describe where two canonical layouts first differ, with a little context on each side."""
    at = next((i for i, (a, b) in enumerate(zip(new, old, strict=False)) if a != b), None)
    if at is None:
        at = min(len(new), len(old))
    start = max(0, at - context)
    return (
        f"first difference at byte {at}: this rank has {new[start : at + context]!r}, "
        f"the deployment has {old[start : at + context]!r}"
    )
