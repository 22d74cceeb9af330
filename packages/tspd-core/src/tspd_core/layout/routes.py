"""Routes between a P rank set and a D rank set (wire.md §6.1–6.4).

:func:`plan_routes` answers, for one DP group of P (TP ``p_tp``) and one D replica (TP
``d_tp``): which P rank sends which piece of every field page to which D rank. The result is
the same for every DP group and every request, so peers plan it once per (P, D) pairing and
share it between threads (it is immutable; its lazily filled caches are idempotent).

Partitioned fields (K/V heads) are re-sliced by intersecting each sending P rank's head
interval with each D rank's. With more ranks than heads a side has replica groups; only the
first rank of a P replica group sends. Replicated fields (MLA latent) are read by D rank ``d``
from P rank ``⌊d·p_tp/d_tp⌋``, spreading the load evenly. At equal TP rank ``r`` ↔ rank ``r``
and every page is copied whole. Example, 8 heads, P TP 2 → D TP 4, NHD pages::

    P0 heads 0-3 ──┬── heads 0-1 ──► D0        rows = tokens per page
                   └── heads 2-3 ──► D1        src stride = 4 heads · dim · width
    P1 heads 4-7 ──┬── heads 4-5 ──► D2        dst stride = 2 heads · dim · width
                   └── heads 6-7 ──► D3        src offset = 2 heads · dim · width for D1
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dc_field
from types import MappingProxyType

from tspd_core.ids import MAX_ROOM, Rank
from tspd_core.layout.compat import check_compatible
from tspd_core.layout.contract import CacheContract, FieldLayout, Partition
from tspd_core.layout.errors import RouteError

MAX_TP = 1024


@dataclass(frozen=True, slots=True)
class Fragment:
    """One strided piece of a field page: ``rows`` runs of ``nbytes`` (wire.md §6.2).

    Run ``r`` reads page offset ``src_offset + r·src_stride`` on P and writes
    ``dst_offset + r·dst_stride`` on D.
    """

    rows: int
    nbytes: int
    src_offset: int
    dst_offset: int
    src_stride: int
    dst_stride: int

    @property
    def total_bytes(self) -> int:
        """Bytes of this fragment per page."""
        return self.rows * self.nbytes


@dataclass(frozen=True, slots=True)
class FieldRoute:
    """The fragments of one field that one P rank sends to one D rank."""

    group_id: str
    field_id: str
    fragments: tuple[Fragment, ...]


@dataclass(frozen=True, slots=True)
class LinkRoute:
    """Everything P rank ``p_rank`` sends D rank ``d_rank`` per request, per page position.

    ``fields`` come in group order, then field-id order; only fields with fragments appear.
    """

    p_rank: Rank
    d_rank: Rank
    fields: tuple[FieldRoute, ...]

    def bytes_per_page(self, group_id: str) -> int:
        """Bytes sent per manifest position of ``group_id``."""
        return sum(
            frag.total_bytes for f in self.fields if f.group_id == group_id for frag in f.fragments
        )


@dataclass(frozen=True, slots=True, eq=False)
class RoutePlan:
    """The frozen route between one P DP group and one D replica (see module docstring).

    Build with :func:`plan_routes`. Immutable; ``cache`` holds derived tables (copy rows,
    stats profiles) filled on first use — concurrent fills compute the same value.
    """

    p_contract: CacheContract
    d_contract: CacheContract
    p_tp: int
    d_tp: int
    links: Mapping[tuple[Rank, Rank], LinkRoute]
    dummies: tuple[Rank, ...]
    _targets: tuple[tuple[Rank, ...], ...]
    _destinations: tuple[tuple[Rank, ...], ...]
    cache: dict[object, object] = dc_field(default_factory=dict, repr=False)

    @property
    def equal_tp(self) -> bool:
        """True when P and D have the same TP size (rank r ↔ rank r, whole pages)."""
        return self.p_tp == self.d_tp

    def _p(self, p_rank: int) -> int:
        if not 0 <= p_rank < self.p_tp:
            raise RouteError(f"P rank {p_rank} is outside 0..{self.p_tp - 1}")
        return p_rank

    def _d(self, d_rank: int) -> int:
        if not 0 <= d_rank < self.d_tp:
            raise RouteError(f"D rank {d_rank} is outside 0..{self.d_tp - 1}")
        return d_rank

    def targets(self, d_rank: int) -> tuple[Rank, ...]:
        """P ranks that send to ``d_rank``: exactly the Success messages it waits for."""
        return self._targets[self._d(d_rank)]

    def destinations(self, p_rank: int) -> tuple[Rank, ...]:
        """D ranks ``p_rank`` sends to: exactly the real pre-allocations it waits for."""
        return self._destinations[self._p(p_rank)]

    def is_dummy(self, p_rank: int) -> bool:
        """True if ``p_rank`` serves no D rank (it still joins P's agreement, wire.md §6.4)."""
        return not self._destinations[self._p(p_rank)]

    def preallocation_fanout(self, p_rank: int) -> int:
        """Pre-allocations P rank ``p_rank`` waits for (a dummy waits for D rank 0's empty one)."""
        return len(self.destinations(p_rank)) or 1

    def success_fanout(self, d_rank: int) -> int:
        """Success messages D rank ``d_rank`` waits for."""
        return len(self.targets(d_rank))

    def contacts(self, d_rank: int) -> tuple[Rank, ...]:
        """P ranks ``d_rank`` registers with: its targets, plus every dummy for D rank 0."""
        if self._d(d_rank) == 0:
            return tuple(sorted(set(self._targets[0]) | set(self.dummies)))
        return self._targets[d_rank]

    def link(self, p_rank: int, d_rank: int) -> LinkRoute | None:
        """What ``p_rank`` sends ``d_rank``, or ``None`` when it sends it nothing."""
        return self.links.get((Rank(self._p(p_rank)), Rank(self._d(d_rank))))


def prefill_dp_group(room: int, prefill_dp_size: int) -> int:
    """The P DP group that serves ``room``: ``room % prefill_dp_size`` (wire.md §6.4)."""
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        raise RouteError(f"room must be an integer in 0..2**63-1, got {room!r}")
    if prefill_dp_size < 1:
        raise RouteError(f"prefill_dp_size must be ≥ 1, got {prefill_dp_size}")
    return room % prefill_dp_size


@dataclass(frozen=True, slots=True)
class _Side:
    """One side's sharding of a partitioned field (wire.md §6.2)."""

    local: int  # x, local extent on the axis
    shards: int  # S = X / x distinct shards
    replicas: int  # R = T / S ranks per shard


def _side(f: FieldLayout, part: Partition, tp: int, name: str) -> _Side:
    local = f.shape[part.axis]
    shards = part.global_extent // local
    if shards > tp or tp % shards:
        # TokenSpeed's planner refuses the same split with the same reason (its words first).
        raise RouteError(
            f"{name} field {f.field_id} cannot map global extent {part.global_extent} and local "
            f"extent {local} to TP={tp}: that makes {shards} distinct shards, and a TP size "
            f"must be a multiple of them; no deployment of this TP size holds this contract"
        )
    return _Side(local, shards, tp // shards)


def _whole(f: FieldLayout) -> tuple[Fragment, ...]:
    size = f.payload_bytes
    return (Fragment(1, size, 0, 0, size, size),)


def _fragments(
    pf: FieldLayout,
    df: FieldLayout,
    part: Partition,
    p: _Side,
    d: _Side,
    p_shard: int,
    d_shard: int,
) -> tuple[Fragment, ...]:
    axis = part.axis
    inner = math.prod(pf.shape[axis + 1 :]) * pf.itemsize
    rows = math.prod(pf.shape[:axis])
    out = []
    base = p_off = d_off = 0
    for extent in part.parts:
        xp, xd = extent // p.shards, extent // d.shards
        p_lo, d_lo = base + p_shard * xp, base + d_shard * xd
        lo, hi = max(p_lo, d_lo), min(p_lo + xp, d_lo + xd)
        if lo < hi:
            frag = Fragment(
                rows,
                (hi - lo) * inner,
                (p_off + lo - p_lo) * inner,
                (d_off + lo - d_lo) * inner,
                p.local * inner,
                d.local * inner,
            )
            if rows > 1 and frag.src_stride == frag.dst_stride == frag.nbytes:
                frag = Fragment(
                    1,
                    rows * frag.nbytes,
                    frag.src_offset,
                    frag.dst_offset,
                    rows * frag.nbytes,
                    rows * frag.nbytes,
                )
            out.append(frag)
        base, p_off, d_off = base + extent, p_off + xp, d_off + xd
    return tuple(out)


def _field_sources(
    pf: FieldLayout, df: FieldLayout, part: Partition | None, p_tp: int, d_tp: int
) -> list[list[tuple[int, tuple[Fragment, ...]]]]:
    """Per D rank: the (P rank, fragments) pairs that feed it this field."""
    if part is None:
        return [[(d * p_tp // d_tp, _whole(pf))] for d in range(d_tp)]
    # Checked at equal TP too: rank r ↔ rank r only works if r's shard is a real one.
    ps, ds = _side(pf, part, p_tp, "P"), _side(df, part, d_tp, "D")
    if p_tp == d_tp:
        return [[(d, _whole(pf))] for d in range(d_tp)]
    out = []
    for d in range(d_tp):
        sources = []
        for shard in range(ps.shards):
            frags = _fragments(pf, df, part, ps, ds, shard, d // ds.replicas)
            if frags:
                sources.append((shard * ps.replicas, frags))
        out.append(sources)
    return out


def plan_routes(
    p_contract: CacheContract, p_tp: int, d_contract: CacheContract, d_tp: int
) -> RoutePlan:
    """Plan the route from a P DP group (TP ``p_tp``) to a D replica (TP ``d_tp``).

    Checks the contracts are compatible first (:class:`ContractMismatch`), then that every
    partitioned field's sharding fits both TP sizes and every group has a transfer policy
    (:class:`RouteError`). Any TP sizes 1..1024 work, multiples or not (2→3, 3→4, ...).
    """
    for name, tp in (("P", p_tp), ("D", d_tp)):
        if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= MAX_TP:
            raise RouteError(f"{name} TP size must be 1..{MAX_TP}, got {tp!r}")
    check_compatible(p_contract, d_contract, our_tp=p_tp, their_tp=d_tp, labels=("P", "D"))
    links: dict[tuple[int, int], list[FieldRoute]] = {}
    memo: dict[object, list[list[tuple[int, tuple[Fragment, ...]]]]] = {}
    for spec in p_contract.group_specs:
        if spec.transfer_policy is None:
            raise RouteError(
                f"group {spec.group_id!r} has no transfer_policy: PD transfer is off for it"
            )
        for pf in p_contract.fields_for_group(spec.group_id):
            df = d_contract.field(pf.field_id)
            part = p_contract.partition(pf.field_id)
            key = (pf.shape, df.shape, pf.itemsize, part)
            if key not in memo:
                memo[key] = _field_sources(pf, df, part, p_tp, d_tp)
            for d, sources in enumerate(memo[key]):
                for p, frags in sources:
                    route = FieldRoute(spec.group_id, pf.field_id, frags)
                    links.setdefault((p, d), []).append(route)
    return _assemble(p_contract, d_contract, p_tp, d_tp, links)


def _assemble(
    p_contract: CacheContract,
    d_contract: CacheContract,
    p_tp: int,
    d_tp: int,
    links: dict[tuple[int, int], list[FieldRoute]],
) -> RoutePlan:
    frozen = {
        (Rank(p), Rank(d)): LinkRoute(Rank(p), Rank(d), tuple(routes))
        for (p, d), routes in sorted(links.items())
    }
    targets = tuple(tuple(Rank(p) for p in range(p_tp) if (p, d) in links) for d in range(d_tp))
    destinations = tuple(
        tuple(Rank(d) for d in range(d_tp) if (p, d) in links) for p in range(p_tp)
    )
    dummies = tuple(Rank(p) for p in range(p_tp) if not destinations[p])
    return RoutePlan(
        p_contract=p_contract,
        d_contract=d_contract,
        p_tp=p_tp,
        d_tp=d_tp,
        links=MappingProxyType(frozen),
        dummies=dummies,
        _targets=targets,
        _destinations=destinations,
    )
